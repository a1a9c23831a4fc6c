"""The GatedDeltaNet mixer core on hybridtune ops, shared by every family (Qwen3.5, Qwen3-Next): conv + delta rule
+ gated norm after a family-specific input projection (`project` of the family file). Tensors [B, T, ...]."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridtune.mixers.gdn import ops as gdn_ops

# Attributes every GatedDeltaNet mixer we route carries (Qwen3.5 and Qwen3-Next alike).
CORE_ATTRS = (
    "conv1d",
    "A_log",
    "dt_bias",
    "norm",
    "out_proj",
    "key_dim",
    "value_dim",
    "head_k_dim",
    "head_v_dim",
    "num_k_heads",
    "num_v_heads",
)


def core_unsupported(module: torch.nn.Module) -> str | None:
    """Why the shared core cannot run this mixer, or None when it can."""
    missing = [a for a in CORE_ATTRS if not hasattr(module, a)]
    if missing:
        return f"missing {', '.join(missing)}"
    conv = module.conv1d
    if not isinstance(conv, torch.nn.Conv1d) or conv.groups != conv.in_channels or conv.weight.shape[1] != 1:
        return "conv1d is not a depthwise Conv1d"
    if getattr(module, "activation", "silu") not in ("silu", "swish"):
        return f"conv activation {module.activation!r} (only silu is routed)"
    if module.num_v_heads % module.num_k_heads:
        return f"value heads {module.num_v_heads} not a multiple of key heads {module.num_k_heads}"
    return None


def gdn_core(
    module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None,
    projection,
    cu_seqlens: torch.Tensor | None,
    chunk_indices: torch.Tensor | None,
) -> torch.Tensor:
    """The GDN mixer on hybridtune ops. hidden [B, T, hidden] -> [B, T, hidden].

    Numerically the upstream training path: conv (SiLU) -> q, k, v; beta = sigmoid(b);
    g = -exp(A_log) * softplus(a + dt_bias) in fp32; delta rule with q/k l2norm in the op; gated RMSNorm
    with z; out_proj. Grouped values stay grouped (no repeat of q/k: the op reads key head j // (HV/H)).
    cu_seqlens [N + 1] / chunk_indices [C, 2] describe a packed batch (batch size must then be 1).
    """
    B, T, _ = hidden_states.shape
    if cu_seqlens is not None and B != 1:
        raise ValueError(
            f"packed batch (cu_seq_lens_q given) must have batch size 1, got input of shape {tuple(hidden_states.shape)}; "
            "PackedCollator lays documents end to end in one row"
        )
    if attention_mask is not None and attention_mask.dim() == 2:
        # Padding mask [B, T] as upstream: zero the padded tokens before they enter the conv and the state.
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    mixed_qkv, z, b, a = projection(module, hidden_states)
    conv = module.conv1d
    mixed_qkv = gdn_ops.causal_conv1d(
        mixed_qkv, conv.weight.squeeze(1), conv.bias, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices
    )
    q, k, v = torch.split(mixed_qkv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(B, T, -1, module.head_k_dim)
    k = k.reshape(B, T, -1, module.head_k_dim)
    v = v.reshape(B, T, -1, module.head_v_dim)
    beta = b.sigmoid()
    # fp32, as upstream: in fp16/bf16 A could overflow to -inf.
    g = -module.A_log.float().exp() * F.softplus(a.float() + module.dt_bias)
    o = gdn_ops.chunk_gated_delta_rule(
        q, k, v, g, beta, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, use_qk_l2norm=True
    )
    o = module.norm(o.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(o.reshape(B, T, -1))


def chunk_indices(doc_lens, chunk_size: int) -> torch.Tensor:
    """int32 [C, 2]: for each chunk of each document, (document index, chunk index within it)."""
    rows = [(d, c) for d, n in enumerate(doc_lens) for c in range(-(-n // chunk_size))]
    return torch.tensor(rows, dtype=torch.int32).reshape(-1, 2)
