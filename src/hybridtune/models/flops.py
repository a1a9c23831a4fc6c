"""FLOPs per training step of a hybrid model (each registered mixer's layers), for MFU and HFU (2 FLOPs per
multiply-add).

Per token, over T = sum(doc_lens) tokens: a decoder weight of P parameters (every `nn.Linear`, the MoE router, the
active experts: top-k routed + shared) costs 2P forward, 6P trained, 4P frozen under LoRA; the LM head likewise, tied
or not; a LoRA adapter r * (in + out) parameters at 6 each (routed experts' adapters for the top-k experts). Each
mixer's projections, core and weight-like parameters (a causal conv) come from its `MixerSpec.flops` (mixers/:
the linear-attention core as Megatron-LM counts it; the attention core 6 * L^2 * head_dim * num_heads forward +
backward per document of length L, causal). Norms, rotary, activations, gates, the loss and the optimizer are not
counted.

Two figures: `model` (for MFU) without recompute; `hardware` (for HFU) adds, under gradient checkpointing, one more
forward of every decoder layer (without the kept cores when the checkpoints keep them: compiler/recompute.py).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from hybridtune.mixers import MIXERS, registry
from hybridtune.models.anatomy import text_config

ADAPTERS = ("lora", "full")


@dataclass
class StepFlops:
    model: float  # model FLOPs per step (for MFU): no recompute
    hardware: float  # hardware FLOPs per step (for HFU): recompute included when gradient checkpointing
    breakdown: dict[str, float] = field(default_factory=dict)
    # keys: linear_frozen, linear_trained, lm_head, lora, each mixer's `core_names` (attention; a linear-attention
    # mixer's core and conv), recompute.
    # model = sum of every key but `recompute`; hardware = model + recompute.


@dataclass(frozen=True)
class LinearTerm:
    """One weight matrix kind of the model, as it sits in the transformers module tree."""

    path: str  # module path, e.g. "model.layers.3.linear_attn.in_proj_qkv", "lm_head"
    in_features: int
    out_features: int
    stored: int = 1  # copies held in the model (num_experts for routed experts)
    active: int = 1  # copies each token goes through (top-k for routed experts)
    is_linear: bool = True  # an nn.Linear that peft target_modules can wrap
    in_decoder: bool = True  # inside a (checkpointed) decoder layer

    @property
    def params(self) -> int:
        return self.in_features * self.out_features * self.stored

    @property
    def active_params(self) -> int:
        return self.in_features * self.out_features * self.active


def _is_moe_layer(c, i: int) -> bool:
    # Qwen3-Next: mlp_only_layers / decoder_sparse_step; Qwen3.5-MoE has neither and every layer is sparse.
    if not getattr(c, "num_experts", 0):
        return False
    if i in (getattr(c, "mlp_only_layers", None) or []):
        return False
    return (i + 1) % (getattr(c, "decoder_sparse_step", None) or 1) == 0


def linear_terms(config) -> list[LinearTerm]:
    """Every weight matrix the FLOP count charges, with its shape, copies stored and copies active per token.

    Mirrors the modeling code of transformers' qwen3_5, qwen3_5_moe and qwen3_next (5.x).
    """
    c = text_config(config)
    h = c.hidden_size
    terms: list[LinearTerm] = []
    for i, kind in enumerate(c.layer_types):
        p = f"model.layers.{i}."
        spec = registry.for_layer_type(kind)
        if spec is None or spec.flops is None:
            known = sorted(t for m in MIXERS.values() if m.flops is not None for t in m.layer_types)
            raise ValueError(f"layer {i}: unknown layer type '{kind}' (expected one of {', '.join(known)})")
        terms += [LinearTerm(p + path, i_f, o_f) for path, i_f, o_f in spec.flops(c, 1, 0.0, 0.0).projections]
        if _is_moe_layer(c, i):
            e, k, mi, si = (
                c.num_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
            )
            terms += [
                LinearTerm(p + "mlp.gate", h, e, is_linear=False),  # router: every token, all experts' logits
                LinearTerm(p + "mlp.experts.gate_up_proj", h, 2 * mi, stored=e, active=k, is_linear=False),
                LinearTerm(p + "mlp.experts.down_proj", mi, h, stored=e, active=k, is_linear=False),
                LinearTerm(p + "mlp.shared_expert.gate_proj", h, si),
                LinearTerm(p + "mlp.shared_expert.up_proj", h, si),
                LinearTerm(p + "mlp.shared_expert.down_proj", si, h),
                LinearTerm(p + "mlp.shared_expert_gate", h, 1),
            ]
        else:
            mi = c.intermediate_size
            terms += [
                LinearTerm(p + "mlp.gate_proj", h, mi),
                LinearTerm(p + "mlp.up_proj", h, mi),
                LinearTerm(p + "mlp.down_proj", mi, h),
            ]
    terms.append(LinearTerm("lm_head", h, c.vocab_size, in_decoder=False))
    return terms


def parameter_counts(config) -> dict[str, int]:
    """Weights the count charges: `total` stored (all experts) and `active` per token; `lm_head` included in both."""
    terms = linear_terms(config)
    return {
        "total": sum(t.params for t in terms),
        "active": sum(t.active_params for t in terms),
        "lm_head": sum(t.params for t in terms if not t.in_decoder),
    }


def _targeted(path: str, targets: Iterable[str]) -> bool:
    return any(path == t or path.endswith("." + t) for t in targets)


def step_flops(
    config,
    doc_lens: Sequence[int],
    *,
    adapter: str = "lora",
    lora_r: int = 0,
    lora_targets: Iterable[str] = (),
    gradient_checkpointing: bool = False,
    lora_parameters: Iterable[str] = (),
    keep_mixer_cores: bool = False,
) -> StepFlops:
    """FLOPs of one optimizer step over the packed documents `doc_lens` (see the module docstring)."""
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS}, not '{adapter}'")
    lens = [int(n) for n in doc_lens]
    if any(n < 0 for n in lens):
        raise ValueError(f"document lengths must be >= 0: {lens}")
    if lora_r < 0:
        raise ValueError(f"lora_r must be >= 0, not {lora_r}")
    c = text_config(config)
    tokens = float(sum(lens))
    sq = float(sum(n * n for n in lens))
    full = adapter == "full"
    base = 6.0 if full else 4.0  # per weight parameter per token: fwd (2) + dgrad (2) [+ wgrad (2)]

    terms = linear_terms(c)
    decoder_params = sum(t.active_params for t in terms if t.in_decoder)
    head_params = sum(t.active_params for t in terms if not t.in_decoder)

    targets, params = tuple(lora_targets), tuple(lora_parameters)
    lora_dec = lora_head = 0
    if not full and lora_r > 0 and (targets or params):
        hit = [t for t in terms if t.is_linear and _targeted(t.path, targets)]
        hit += [t for t in terms if t.stored > 1 and _targeted(t.path, params)]  # routed experts' 3-D weights
        if not hit:
            raise ValueError(f"none of lora_targets {list(targets + params)} names a weight of this model")
        lora_dec = sum(lora_r * (t.in_features + t.out_features) * t.active for t in hit if t.in_decoder)
        lora_head = sum(lora_r * (t.in_features + t.out_features) * t.active for t in hit if not t.in_decoder)

    # Each registered mixer's layers (`MixerSpec.flops`): its core's forward and its weight-like parameters.
    mixers = []
    for spec in MIXERS.values():
        if spec.flops is None:
            continue
        n = sum(1 for k in c.layer_types if registry.for_layer_type(k) is spec)  # the first serving mixer's
        mixers.append((spec, spec.flops(c, n, tokens, sq) if n else None))
    weights = sum(f.weights for _, f in mixers if f is not None)
    breakdown = {
        "linear_frozen": 0.0 if full else 4.0 * decoder_params * tokens,
        "linear_trained": 6.0 * decoder_params * tokens if full else 0.0,
        "lm_head": base * head_params * tokens,
        "lora": 6.0 * (lora_dec + lora_head) * tokens,
    }
    for spec, f in mixers:
        core_key, weights_key = spec.core_names
        breakdown[core_key or f"{spec.kind}_core"] = 3.0 * f.core if f else 0.0
        if weights_key:
            breakdown[weights_key] = base * f.weights * tokens if f else 0.0
    recompute = 0.0
    if gradient_checkpointing:
        # Kept cores (compiler/recompute.py) are those of the mixers whose `core_kept`; the packed batches' varlen
        # attention is recomputed.
        recompute = 2.0 * (decoder_params + weights + lora_dec) * tokens
        recompute += sum(f.core for spec, f in mixers if f and not (keep_mixer_cores and spec.core_kept))
    breakdown["recompute"] = recompute
    model = sum(v for k, v in breakdown.items() if k != "recompute")
    return StepFlops(model=model, hardware=model + recompute, breakdown=breakdown)


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Utilisation: achieved FLOP/s over the peak. Pass `model` FLOPs for MFU, `hardware` FLOPs for HFU."""
    if step_seconds <= 0 or peak_flops <= 0:
        raise ValueError(f"step_seconds and peak_flops must be > 0 (got {step_seconds}, {peak_flops})")
    return flops_per_step / step_seconds / peak_flops


def measure_peak(device: torch.device) -> dict:
    """The dense matmul throughput MFU and HFU are taken against: bf16 8192^3 on a GPU, fp32 1024^3 on CPU
    (median of timed repeats, the device synchronised around each). Measured, not a datasheet figure: the
    same GPU model differs by clocks, power cap and driver."""
    n, dtype, reps = (8192, torch.bfloat16, 30) if device.type == "cuda" else (1024, torch.float32, 5)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return {"matmul": f"{n}^3 {str(dtype).removeprefix('torch.')}", "flops_per_s": 2 * n**3 / med, "median_s": med}
