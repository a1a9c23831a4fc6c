"""A toy mixer registered from a test through the public registry API only: a gated linear recurrence per packed
document, h_t = a_t * h_{t-1} + b_t * x_t (a_t, b_t in (0, 1) per value head), routed onto the linear-attention
modules of the tiny Qwen3.5 preset (it reuses their in_proj_z / in_proj_a / in_proj_b / out_proj weights).

Its batch metadata is `toy_doc_ids` int64 [T] (the document of every token), from the collator through the
registry. The recurrence is computed in closed form with a [T, T] decay matrix (pure torch, traceable):
h_t = sum_{s <= t, same document} exp(cum_t - cum_s) * b_s * x_s, cum = cumsum(log a).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtune.mixers.registry import Activations, Family, LayerFlops, MixerSpec

KIND = "toy"
DOC_IDS = "toy_doc_ids"
LAYER_TYPE = "linear_attention"  # the tiny preset's layers it takes over
TOY_ATTRS = ("in_proj_z", "in_proj_a", "in_proj_b", "out_proj", "num_v_heads", "head_v_dim")


def toy_recurrence(x: torch.Tensor, log_a: torch.Tensor, b: torch.Tensor, doc_ids: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, V], log_a and b [B, T, H], doc_ids [T] -> h [B, T, H, V]."""
    cum = torch.cumsum(log_a.float(), dim=1)  # [B, T, H]
    diff = cum[:, :, None, :] - cum[:, None, :, :]  # [B, t, s, H]
    T = x.shape[1]
    idx = torch.arange(T, device=x.device)
    keep = (idx[:, None] >= idx[None, :]) & (doc_ids[:, None] == doc_ids[None, :])  # [t, s]
    decay = torch.where(keep[None, :, :, None], diff, torch.full_like(diff, float("-inf"))).exp()
    return torch.einsum("btsh,bshv->bthv", decay, (b.float()[..., None] * x.float())).to(x.dtype)


def toy_reference(x, log_a, b, doc_ids) -> torch.Tensor:
    """The recurrence step by step (the definition), for the closed form's check."""
    h = torch.zeros_like(x[:, 0], dtype=torch.float32)
    out = []
    for t in range(x.shape[1]):
        if t > 0 and doc_ids[t] != doc_ids[t - 1]:
            h = torch.zeros_like(h)
        h = log_a[:, t].float().exp()[..., None] * h + b[:, t].float()[..., None] * x[:, t].float()
        out.append(h)
    return torch.stack(out, dim=1).to(x.dtype)


def _matches(module) -> bool:
    return all(hasattr(module, a) for a in TOY_ATTRS)


def _forward(module, hidden_states, attention_mask, kwargs):
    doc_ids = kwargs.get(DOC_IDS)
    if doc_ids is None:
        raise ValueError(f"the toy mixer needs the batch key {DOC_IDS!r} (its registry metadata)")
    B, T, _ = hidden_states.shape
    x = module.in_proj_z(hidden_states).reshape(B, T, -1, module.head_v_dim)
    log_a = F.logsigmoid(module.in_proj_a(hidden_states))
    b = torch.sigmoid(module.in_proj_b(hidden_states))
    h = toy_recurrence(x, log_a, b, doc_ids.reshape(-1))
    return module.out_proj(h.reshape(B, T, -1))


def _metadata(doc_lens) -> dict:
    lens = torch.tensor(list(doc_lens))
    return {DOC_IDS: torch.repeat_interleave(torch.arange(len(lens)), lens)}


def _flops(c, layers: int, tokens: float, sq: float) -> LayerFlops:
    h, hv, dv = c.hidden_size, c.linear_num_value_heads, c.linear_value_head_dim
    proj = (("linear_attn.in_proj_z", h, hv * dv), ("linear_attn.in_proj_a", h, hv), ("linear_attn.in_proj_b", h, hv))
    # the [T, T] decay matrix per document and head: 2 * L^2 * H * V multiply-adds forward
    return LayerFlops(proj + (("linear_attn.out_proj", hv * dv, h),), core=layers * 2.0 * sq * hv * dv)


def _activations(c) -> Activations:
    v = c.linear_num_value_heads * c.linear_value_head_dim
    return Activations(saved=3 * v + 2 * c.linear_num_value_heads, core=v)


def _path(module) -> tuple[str, bool]:
    return "toy recurrence (pure torch)", False


def make_spec() -> MixerSpec:
    return MixerSpec(
        kind=KIND,
        layer_types=(LAYER_TYPE,),
        routing=lambda: (Family("toy-recurrence", _matches, _forward, describe=lambda m: "toy -> pure torch"),),
        flops=_flops,
        core_names=("toy_core", ""),
        activations=_activations,
        batch_keys=(DOC_IDS,),
        dynamic_keys=(DOC_IDS,),
        metadata=_metadata,
        path=_path,
    )
