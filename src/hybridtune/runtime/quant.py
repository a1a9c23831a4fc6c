"""QLoRA's frozen base: the text model's large weights in 4-bit NF4 (ops/nf4.py, torchao's NF4Tensor), LoRA on top.

What is quantised (`targets`): every `nn.Linear` of the decoder layers (attention q/k/v/o, the linear-attention
projections in_proj_qkv / in_proj_z / in_proj_b / in_proj_a / out_proj and Qwen3-Next's in_proj_qkvz / in_proj_ba,
the MLPs and the shared expert's) and the routed experts' fused 3-D `gate_up_proj` / `down_proj`. What stays in the
run's dtype (bf16): the embeddings, lm_head, every norm, the linear-attention conv1d, A_log and dt_bias, the MoE
router, a one-output Linear (the shared expert's gate) and any weight whose size is not a multiple of NF4's 64-value
block; a vision tower stays as saved. The LoRA adapters are fp32 as under plain LoRA.

The base is quantised while it loads (`materialize_quantized`): built on the meta device, each parameter is read
(a checkpoint's tensors from its safetensors, a preset's drawn by its seeded init one decoder layer at a time),
moved to the device and, if a target, quantised there before the next is read: the whole model is never held in
bf16. A checkpoint that cannot load shard by shard loads whole and is quantised in place (said in the log).
"""

from __future__ import annotations

import logging

import torch

from hybridtune.errors import ConfigError
from hybridtune.models import experts
from hybridtune.models.anatomy import text_model
from hybridtune.models.meta import reset_buffers
from hybridtune.ops import nf4

logger = logging.getLogger(__name__)

QUANTIZATION = "nf4"  # what final/hybridtune.json records as `base_quantization`
# A weight "holds NF4's values" when its round trip through NF4 moves no value by more than this fraction of its
# 64-value block's largest value. NF4's values come back with the same 4-bit codes: only each block's double-quantised
# scale drifts, by about a bf16 rounding (measured <= 2^-7 on normal weights, bf16 and fp32, 2-D and 3-D), while a
# weight not yet quantised moves in some block by >= 15% of its largest value (measured on normal, heavy-tailed and
# outlier-scaled weights: NF4's widest gap between levels is 0.28). (Relative to each value instead, the drift of a
# small value reaches 2^-6 at 2 bf16 ulps: no margin.) Weights whose block scales vary widely drift more through the
# scales' int8 grid: those are put through NF4 again, which is what training did with them.
NF4_VALUES_TOL = 2**-5
# What export once wrote in a QLoRA run's base_model/ to say "NF4's values already": merge reads it only to warn.
LEGACY_MARKER = "dequantized.json"


def targets(model: torch.nn.Module) -> dict[str, str]:
    """Parameter name (as `model.named_parameters` gives it) -> why it is quantised, for every NF4 target of the
    text model's decoder layers (see the module doc). Reads shapes only: works on the meta device."""
    layers = text_model(model).layers
    prefix = next(n for n, m in model.named_modules() if m is layers)
    found: dict[str, str] = {}
    for name, m in layers.named_modules():
        full = f"{prefix}.{name}" if name else prefix
        if isinstance(m, torch.nn.Linear) and m.out_features > 1 and nf4.quantizable(m.weight):
            found[f"{full}.weight"] = "linear"
        elif experts.is_experts(m):
            for p in experts.PARAMETERS:
                if nf4.quantizable(getattr(m, p)):
                    found[f"{full}.{p}"] = "experts"
    return found


def check_supported(world: int, engine: str) -> None:
    """One process for now: DDP's start-up broadcast and FSDP2's shards of NF4 weights are not built."""
    if world > 1 or engine == "fsdp":
        raise ConfigError(
            "load_in_4bit (QLoRA) runs in one process for now (a 4-bit base under DDP or FSDP2 is not built); "
            "run without --nproc, or use adapter: lora on the bf16 base"
        )


def _owners(model: torch.nn.Module) -> dict[int, list[tuple[torch.nn.Module, str]]]:
    """id(parameter) -> every (module, attribute) holding it (a tied weight has two)."""
    owners: dict[int, list] = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))
    return owners


def _set(owners, old: torch.nn.Parameter, new: torch.nn.Parameter) -> None:
    for module, attr in owners[id(old)]:
        module._parameters[attr] = new


@torch.no_grad()
def materialize_quantized(loaded, device: torch.device, dtype: torch.dtype) -> dict:
    """Give `loaded.model` its values on `device` with its targets in NF4 (see the module doc): one parameter read
    at a time from `loaded.reader` when it was built on the meta device, else the loaded weights quantised in place.
    The rest is cast to `dtype` (the text model's; a frozen vision tower stays as saved). Returns figures for the log."""
    if not nf4.available():
        raise ConfigError(nf4.MISSING)
    model = loaded.model
    wanted = targets(model)
    text = {id(p) for p in text_model(model).parameters()}
    owners = _owners(model)
    reader = loaded.reader() if loaded.reader is not None else None
    figures = {"nf4_bytes": 0, "nf4_weights": 0, "dense_bytes": 0, "bf16_bytes_of_targets": 0}
    try:
        for name, p in list(model.named_parameters()):
            if reader is not None:
                block = reader(name, 0, p.shape[0] if p.dim() else 0)
            else:
                block = p.detach()
            if name in wanted:  # (cast on the host: the device holds the bf16 tensor alone, then its NF4)
                t = nf4.quantize(block.to(torch.bfloat16).to(device))
                figures["nf4_bytes"] += nf4.nbytes(t)
                figures["nf4_weights"] += 1
                figures["bf16_bytes_of_targets"] += block.numel() * 2
                _set(owners, p, torch.nn.Parameter(t, requires_grad=False))
                continue
            keep = dtype if (id(p) in text and p.is_floating_point()) else p.dtype
            t = block.to(device=device, dtype=keep)
            figures["dense_bytes"] += t.numel() * t.element_size()
            _set(owners, p, torch.nn.Parameter(t, requires_grad=p.requires_grad))
    finally:
        if reader is not None:
            reader.close()
    if reader is not None:
        for module in model.modules():
            for bname, b in list(module._buffers.items()):
                if b is not None and b.is_meta:
                    module._buffers[bname] = torch.empty(b.shape, dtype=b.dtype, device=device)
        reset_buffers(model)
        loaded.reader = None
    else:
        model.to(device)
    logger.info(
        "QLoRA base: %d weights in NF4 (%s; %s in bf16), the rest %s in %s (embeddings, lm_head, norms, "
        "linear-attention conv/A_log/dt_bias, router, gates)",
        figures["nf4_weights"],
        _size(figures["nf4_bytes"]),
        _size(figures["bf16_bytes_of_targets"]),
        _size(figures["dense_bytes"]),
        str(dtype).removeprefix("torch."),
    )
    return figures


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


def is_quantized(model: torch.nn.Module) -> bool:
    """Whether `model` (peft-wrapped or not) holds an NF4 weight."""
    return any(nf4.is_nf4(p) for p in model.parameters())


def dequantized_state(state: dict, dtype: torch.dtype) -> dict:
    """A state dict with every NF4 tensor dequantised into `dtype` (the checkpoint's own); the rest as it is."""
    return {k: nf4.dequantize(v, dtype) if nf4.is_nf4(v) else v for k, v in state.items()}


def holds_nf4_values(weight: torch.Tensor, rounded: torch.Tensor) -> bool:
    """Whether `weight` already holds NF4's values (a QLoRA base written dequantised), given `rounded`, its round
    trip through NF4: no value moved by more than NF4_VALUES_TOL of its block's largest value (a zero block stays)."""
    w = weight.detach().float().reshape(-1, nf4.BLOCK)
    moved = (rounded.detach().float().reshape(-1, nf4.BLOCK) - w).abs()
    return bool((moved <= NF4_VALUES_TOL * w.abs().amax(dim=1, keepdim=True)).all())


@torch.no_grad()
def roundtrip_targets(model: torch.nn.Module) -> tuple[int, int]:
    """Every NF4 target of a plain (unquantised) model given its values through NF4 and back, in its own dtype: the
    base a QLoRA adapter trained on, for merging or loading it (run/merge.py, infer/load.py). A weight that already
    holds NF4's values (the dequantised base_model/ a QLoRA run on a preset writes) is kept as it is: it is read
    from the weights themselves, never from a file beside them that anyone could place in a base's folder. A weight
    kept is within NF4_VALUES_TOL (of each block's largest value) of its round trip, so keeping it differs from
    quantising it as training did by no more than that. Every target is checked, each on its own: the round trip is
    what a base not yet quantised needs anyway, and a base with one weight replaced still has that one quantised.
    Returns (weights rounded, weights kept)."""
    if not nf4.available():
        raise ConfigError(nf4.MISSING)
    params = dict(model.named_parameters())
    rounded = kept = 0
    for name in targets(model):
        p = params[name]
        r = nf4.roundtrip(p.data)
        if holds_nf4_values(p.data, r):
            kept += 1
        else:
            p.data, rounded = r, rounded + 1
    return rounded, kept
