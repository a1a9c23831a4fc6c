"""Routed MoE experts as grouped GEMMs, and peft's LoRA on them in the same grouped form.

transformers stores each layer's routed experts as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] and runs them
through its experts interface. `route_experts(model)` registers and selects `hybridtune_grouped` there: the T x top_k
(token, expert) pairs are sorted by expert, the per-expert offsets come from `searchsorted` (a tensor of E entries),
each projection is one grouped GEMM over all experts, and the weighted outputs return to their tokens by `index_copy`
and a sum over top_k; every shape is T x top_k whatever the routing. The GEMM is `F.grouped_mm` in bf16 (CUDA sm80+,
the CPU); other dtypes or unaligned sizes use transformers' `grouped_mm_fallback` eagerly, `gathered_mm` compiled.

`route_lora(model)` gives each outermost peft `ParamWrapper` (LoRA through `target_parameters`) a forward computing,
per expert e and routed row x, `x W_e^T + s (x A_e^T) B_e` as three grouped GEMMs (`lora_A` [E*r, in] read as A_e
[r, in], `lora_B` [out, r*E] read as B_e [r, out], s = alpha/r), never forming the [E, out, in] delta; the adapter
saved is peft's own. Other adapter states or layouts keep peft's forward. A QLoRA base holds the two weights in NF4.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from transformers.integrations import moe as hf_moe

from hybridtune.ops import nf4

try:  # pins an operand's layout inside a compiled graph (see _Dense)
    from torch._inductor.inductor_prims import force_stride_order as _force_stride_order
except ImportError:  # a torch without it: eager layouts only
    _force_stride_order = None

NAME = "hybridtune_grouped"
PARAMETERS = ("gate_up_proj", "down_proj")
ORIGINAL_FORWARD = _ORIGINAL = "_hybridtune_original_experts_forward"  # on a wrapper route_lora changed
_ROUTED = "_hybridtune_experts_routed"


def is_experts(module: torch.nn.Module) -> bool:
    """A transformers experts module of the layout this path computes: `gate_up_proj` [E, 2I, H] and `down_proj`
    [E, H, I] (gate and up concatenated, not transposed, no bias), dispatched by the experts interface."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and gate_up.dim() == 3
        and down.dim() == 3
        and getattr(module, "has_gate", False)
        and not getattr(module, "has_bias", True)
        and not getattr(module, "is_transposed", True)
        and getattr(module, "is_concatenated", True)
        and hasattr(module, "config")
        and gate_up.shape[0] == down.shape[0] == getattr(module, "num_experts", -1)
    )


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on `t` computes in: autocast's where autocast is on for its device, else its own."""
    dev = t.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return t.dtype


def _fast(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `F.grouped_mm(a, b)` runs (and compiles): bf16 operands, every matrix dimension a multiple of
    16 bytes, a device with grouped GEMMs (sm80+ CUDA, or the CPU)."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16 or not hasattr(F, "grouped_mm"):
        return False
    if any(n % 8 for n in (a.shape[-1], b.shape[-1])):
        return False
    if a.device.type == "cuda":
        return torch.cuda.get_device_capability(a.device) >= (8, 0)
    return a.device.type == "cpu"


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows `offs[e-1]:offs[e]` of `a` [S, k] times `b[e]` [k, n], for every expert e, as one grouped GEMM."""
    if _fast(a, b):
        return F.grouped_mm(a, b, offs=offs)
    if torch.compiler.is_compiling():
        # grouped_mm compiles in bf16 only, and the backward of transformers' fallback op reads the offsets on
        # the host (a data-dependent guard): gather each row's expert matrix instead. Exact and traceable, it holds
        # S x k x n elements, so it is the path of small float32/float64 shapes (CPU tests); GPU steps compute bf16.
        return gathered_mm(a, b, offs)
    return torch.ops.transformers.grouped_mm_fallback(a, b, offs)


def gathered_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` as a batched product of each row with its expert's matrix (row s belongs to the first expert
    whose end offset exceeds s)."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)
    expert = torch.searchsorted(offs, rows, right=True)
    return torch.bmm(a.unsqueeze(1), b[expert]).squeeze(1)


def route(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, offs): the (token, slot) pairs in expert order (`perm` indexes `top_k_index.reshape(-1)`), and the
    int32 end offset of each expert's rows. Empty experts have equal offsets; every size is T x top_k."""
    ids = top_k_index.reshape(-1)
    sorted_ids, perm = torch.sort(ids, stable=True)
    experts = torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    return perm, offs


def lora_factors(wrapper, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(A [E, r, in], B [E, r, out], scaling) of one peft ParamWrapper adapter on an [E, out, in] parameter:
    expert e's delta is scaling * B[e]^T @ A[e], the `get_delta_weight` of peft. Views of peft's parameters."""
    a = wrapper.lora_A[adapter].weight  # [E * r, in], row e * r + j
    b = wrapper.lora_B[adapter].weight  # [out, r * E], column j * E + e
    e, r = wrapper.num_experts, wrapper.r[adapter]
    return a.view(e, r, a.shape[-1]), b.view(b.shape[0], r, e).permute(2, 1, 0), wrapper.scaling[adapter]


class _Dense(torch.autograd.Function):
    """`t` laid out contiguously, a layout the compiled graph must keep. Inductor hands grouped_mm an operand in the
    layout it chose for it, which for a permuted or cast tensor can be one grouped_mm refuses ("Invalid
    strides"); `force_stride_order` pins it (a copy only where the layout differs)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        if _force_stride_order is None or not torch.compiler.is_compiling():
            return t.contiguous()
        strides = [1] * t.dim()
        for i in range(t.dim() - 2, -1, -1):
            strides[i] = strides[i + 1] * t.shape[i + 1]
        return _force_stride_order(t, strides)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; a cast copy is pinned contiguous (a parameter already in `dtype` keeps its own layout)."""
    return t if t.dtype == dtype else _Dense.apply(t.to(dtype))


def _project(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, factors) -> torch.Tensor:
    """x [S, in] through each row's expert of `weight` [E, out, in] (an NF4 one: ops/nf4.py, dequantised inside the
    product and again in its backward), plus its LoRA `factors` (A, B, s) if any."""
    if nf4.is_nf4(weight):
        y = nf4.grouped(x, weight, offs, grouped_mm)
    else:
        y = grouped_mm(x, _cast(weight, x.dtype).transpose(1, 2), offs)
    if factors is None:
        return y
    a, b, scaling = factors
    a = _cast(a, x.dtype)  # [E, r, in]: a contiguous view of peft's lora_A
    r = a.shape[1]
    if x.dtype == torch.bfloat16 and r % 8:
        # Zero rank rows (A) and rows (B) add nothing and align the rank for the grouped GEMM.
        pad = 8 - r % 8
        a, b = _Dense.apply(F.pad(a, (0, 0, 0, pad))), F.pad(b, (0, 0, 0, pad))
    low = grouped_mm(x, a.transpose(1, 2), offs) * scaling
    return y + grouped_mm(low, _Dense.apply(b.to(x.dtype)), offs)


def grouped_experts_forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    lora: dict | None = None,
) -> torch.Tensor:
    """The experts' output [T, H] for `hidden_states` [T, H] routed to `top_k_index` [T, k] with `top_k_weights`
    [T, k], as transformers' eager experts loop computes it; `lora` maps a parameter name to its (A, B, s)."""
    lora = lora or {}
    tokens, k = top_k_index.shape
    perm, offs = route(top_k_index, self.num_experts)
    dtype = compute_dtype(hidden_states)
    x = hidden_states[perm // k].to(dtype)
    h = _project(x, self.gate_up_proj, offs, lora.get("gate_up_proj"))
    h = self._apply_gate(h)
    y = _project(h, self.down_proj, offs, lora.get("down_proj"))
    y = y * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(y).index_copy(0, perm, y)
    return out.view(tokens, k, -1).sum(dim=1).to(hidden_states.dtype)


def register() -> str:
    """Register `hybridtune_grouped` in transformers' experts interface (idempotent); returns its name."""
    hf_moe.ExpertsInterface.register(NAME, grouped_experts_forward)
    return NAME


def route_experts(model: torch.nn.Module) -> dict[str, str]:
    """Select `hybridtune_grouped` for every experts module of `model` (idempotent); returns module name -> path.
    `unroute_experts` restores each config's previous implementation."""
    report: dict[str, str] = {}
    found = [(n, m) for n, m in model.named_modules() if is_experts(m)]
    if not found:
        return report
    register()
    previous: dict[int, str | None] = {}  # id(config) -> the implementation this call replaced
    for name, m in found:
        cfg = m.config
        if cfg._experts_implementation != NAME:  # the implementation it had is what unroute gives back
            previous[id(cfg)] = cfg._experts_implementation
            cfg._experts_implementation_internal = NAME
        # The marker lives on the module, not the config: a config attribute would be written into config.json.
        if id(cfg) in previous or _ROUTED not in m.__dict__:
            m.__dict__[_ROUTED] = previous.get(id(cfg))
        e, i2, h = m.gate_up_proj.shape
        report[name] = f"{NAME}: {e} experts, {h} -> 2x{i2 // 2} -> {h}, grouped GEMMs (was {m.__dict__[_ROUTED]})"
    return report


def unroute_experts(model: torch.nn.Module) -> int:
    """Give every routed experts module its previous implementation back; returns how many configs changed."""
    changed = set()
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if is_experts(m) and cfg is not None and _ROUTED in m.__dict__:
            previous = m.__dict__.pop(_ROUTED)
            if cfg._experts_implementation == NAME:
                cfg._experts_implementation_internal = previous
                changed.add(id(cfg))
    return len(changed)


def is_routed(module: torch.nn.Module) -> bool:
    cfg = getattr(module, "config", None)
    return cfg is not None and getattr(cfg, "_experts_implementation", None) == NAME


def _chain(outer) -> tuple[torch.nn.Module, dict]:
    """(the experts module, parameter name -> ParamWrapper) of a stack of nested peft ParamWrappers."""
    from peft.tuners.lora.layer import ParamWrapper

    wrappers, m = {}, outer
    while isinstance(m, ParamWrapper):
        wrappers[m.parameter_name] = m
        m = m.base_layer
    return m, wrappers


def _single_adapter(wrappers: dict) -> str | None:
    """The one active adapter every wrapper holds, unmerged and enabled; None where peft's forward must run."""
    names = set()
    for w in wrappers.values():
        if w.disable_adapters or w.merged:
            return None
        active = [a for a in w.active_adapters if a in w.lora_A]
        if len(active) != 1:
            return None
        names.add(active[0])
    return names.pop() if len(names) == 1 else None


def _lora_forward(self, hidden_states, top_k_index, top_k_weights, *args, **kwargs):
    experts, wrappers = _chain(self)
    adapter = None if (args or kwargs) else _single_adapter(wrappers)
    if adapter is None:
        return self.__dict__[_ORIGINAL](hidden_states, top_k_index, top_k_weights, *args, **kwargs)
    lora = {name: lora_factors(w, adapter) for name, w in wrappers.items()}
    return grouped_experts_forward(experts, hidden_states, top_k_index, top_k_weights, lora=lora)


def route_lora(model: torch.nn.Module) -> dict[str, str]:
    """Give every outermost peft ParamWrapper over a routed experts module the grouped LoRA forward (idempotent);
    returns module name -> what it computes. Experts that `route_experts` did not route keep peft's forward."""
    try:
        from peft.tuners.lora.layer import ParamWrapper
    except ImportError:  # no peft: nothing wraps the experts
        return {}
    report: dict[str, str] = {}
    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, ParamWrapper)}
    for name, m in model.named_modules():
        if not isinstance(m, ParamWrapper) or id(m) in inner:
            continue
        experts, wrappers = _chain(m)
        if not (is_experts(experts) and is_routed(experts)) or not set(wrappers) <= set(PARAMETERS):
            continue
        if _ORIGINAL not in m.__dict__:
            m.__dict__[_ORIGINAL] = m.forward
            m.forward = types.MethodType(_lora_forward, m)
        report[name] = f"{NAME} + LoRA on {', '.join(sorted(wrappers))} (grouped x A_e B_e)"
    return report


def unroute_lora(model: torch.nn.Module) -> int:
    """Give the wrappers `route_lora` changed peft's forward back; returns how many."""
    n = 0
    for m in model.modules():
        if _ORIGINAL in m.__dict__:
            m.__dict__.pop(_ORIGINAL)
            m.__dict__.pop("forward", None)
            n += 1
    return n
