"""How much GPU memory a training step needs, estimated from the model's config before the first step: what
`gradient_checkpointing: auto` (and `fsdp_units: auto`) decides on.

The estimate adds to what the loaded model holds: gradients and AdamW state (`state_bytes`, measured from the model),
the activations the backward keeps (per token and per layer, from the config's widths, as the compiled loop keeps
them; with checkpointing each layer's input, one layer recomputed at a time), one layer's backward transients, the
loss head and a fixed allowance. Under FSDP2 with layer units (`layer`, `group:K`) the model's own share per GPU comes
from the model (`ShardedModel`); `fsdp_group` picks the largest K whose step fits. The figures err on the high side;
the first step's out-of-memory retry (oom.py) covers an estimate that was too low.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridtune.mixers import MIXERS, registry
from hybridtune.mixers.registry import Activations
from hybridtune.models.anatomy import decoder_layers
from hybridtune.ops import nf4

# Workspaces (cuBLAS, FLA's kernels), the fused loss's logits chunk (ops/loss.py: about 1 GiB in fp32) and the
# allocator's slack: a fixed allowance on top of the per-token bytes.
FIXED_OVERHEAD = 2**30
# The share of the GPU's available memory an estimate may fill and still count as fitting.
FIT_SHARE = 0.9
GIB = 2**30


@dataclass(frozen=True)
class ActivationShapes:
    """The widths of a decoder stack that decide its activations per token (elements, not bytes); each layer type's
    mixer widths from its registered mixer (`MixerSpec.activations`; a type no mixer serves counts as attention)."""

    hidden: int
    layer_types: tuple[str, ...]  # the config's layer type per layer ("linear_attention", "full_attention", ...)
    mlp: int  # the MLP's width per token: dense intermediate, or an MoE's top-k experts plus its shared expert
    vocab: int
    mixers: tuple[tuple[str, Activations], ...] = ()  # (layer type, its mixer's per-token elements)

    @classmethod
    def of(cls, config) -> ActivationShapes:
        """From a transformers text config (Qwen3.5, Qwen3-Next and their MoE forms, attention-only configs)."""
        g = lambda name, default=0: getattr(config, name, None) or default  # noqa: E731
        hidden, n = g("hidden_size"), g("num_hidden_layers")
        experts = g("num_experts_per_tok")
        mlp = g("intermediate_size")
        if experts and g("moe_intermediate_size"):
            mlp = experts * g("moe_intermediate_size") + g("shared_expert_intermediate_size")
        kinds = tuple(g("layer_types", ["full_attention"] * n))
        widths = []
        for kind in dict.fromkeys(kinds):
            spec = registry.for_layer_type(kind)
            if spec is None or spec.activations is None:
                spec = MIXERS["attention"]
            widths.append((kind, spec.activations(config)))
        return cls(hidden=hidden, layer_types=kinds, mlp=mlp, vocab=g("vocab_size"), mixers=tuple(widths))

    def widths(self, kind: str) -> Activations:
        """The per-token elements of a layer of type `kind` (its mixer's)."""
        return dict(self.mixers).get(kind) or Activations(saved=0)

    def layer_elements(self, kind: str) -> int:
        """Elements per token one layer keeps for its backward without checkpointing (see the module doc)."""
        common = 4 * self.hidden + 3 * self.mlp  # its input, both norms' outputs, the residual; MLP gate/up/product
        return common + self.widths(kind).saved

    def core_elements(self, kind: str) -> int:
        """Elements per token a checkpointed layer keeps when its mixer's core is not recomputed
        (compiler/recompute.py; `Activations.core` of its mixer)."""
        return self.widths(kind).core

    def backward_fp32_elements(self, kind: str) -> int:
        """fp32 elements per token a layer's backward adds (a chunked mixer's states and their gradients)."""
        return self.widths(kind).backward_fp32


@dataclass(frozen=True)
class Estimate:
    """Bytes a step adds to what is resident, with and without checkpointing."""

    without: int
    with_checkpointing: int
    keeping_cores: int  # with checkpointing whose layers keep their mixers' cores (compiler/recompute.py)


def step_bytes(shapes: ActivationShapes, tokens: int, *, bf16: bool, fused_loss: bool, state_bytes: int) -> Estimate:
    """The estimate for micro-batches of `tokens` tokens (see the module doc); `state_bytes`: gradients and AdamW
    state the run allocates beside the resident model."""
    b = 2 if bf16 else 4
    kinds = shapes.layer_types
    saved = [shapes.layer_elements(k) * b for k in kinds]
    # One layer's backward at a time: gradients as large as what it kept, plus the delta rule's fp32 states.
    transient = max(s + shapes.backward_fp32_elements(k) * 4 for s, k in zip(saved, kinds)) if kinds else 0
    # The final norm's output and its gradient; without the fused loss, the [tokens, vocab] logits, their fp32
    # upcast and its gradient.
    head = 2 * shapes.hidden * 4 + (0 if fused_loss else shapes.vocab * (b + 4 + 4))
    fixed = state_bytes + FIXED_OVERHEAD
    without = fixed + tokens * (sum(saved) + transient + head)
    # Checkpointed: every layer's input, and one layer recomputed (what it keeps, then its backward's transients).
    ckpt = fixed + tokens * (len(kinds) * shapes.hidden * b + max(saved, default=0) + transient + head)
    cores = tokens * sum(shapes.core_elements(k) for k in kinds) * b
    return Estimate(without=without, with_checkpointing=ckpt, keeping_cores=ckpt + cores)


@dataclass(frozen=True)
class Decision:
    on: bool
    reason: str
    warning: str | None = None


def decide_checkpointing(est: Estimate, available: int, tokens: int) -> Decision:
    """On when the step without checkpointing would fill more than FIT_SHARE of `available` (bytes the GPU has
    for the step: free memory after the model loaded), off otherwise; the reason gives the figures."""
    room = FIT_SHARE * available
    figures = (
        f"{tokens}-token micro-batches need about {est.without / GIB:.1f} GiB without checkpointing, "
        f"{est.with_checkpointing / GIB:.1f} GiB with it; {available / GIB:.1f} GiB free"
    )
    if est.without <= room:
        return Decision(False, f"auto: off: {figures}")
    if est.with_checkpointing <= room:
        return Decision(True, f"auto: on: {figures}")
    return Decision(
        True,
        f"auto: on: {figures}",
        f"gradient_checkpointing: even with checkpointing the estimate ({est.with_checkpointing / GIB:.1f} GiB) "
        f"exceeds {FIT_SHARE:.0%} of the {available / GIB:.1f} GiB free; the step may run out of memory (a shorter "
        "sequence_len, or LoRA, needs less)",
    )


def fsdp_param_bytes(p, bf16: bool) -> tuple[int, int, int]:
    """One parameter under FSDP2 (mixed precision as in runtime/distributed.py): (its bytes over all shards: the
    parameter, and for a trainable one its gradient and AdamW's two moments; gathered, in the compute dtype; its
    unsharded gradient, counted in the compute dtype and as the reduce-scatter's input, fp32 under bf16)."""
    n, size = p.numel(), p.element_size()
    compute = 2 if bf16 else size
    grad = n * (compute + (4 if bf16 else size)) if p.requires_grad else 0
    return n * size * (4 if p.requires_grad else 1), n * compute, grad


@dataclass(frozen=True)
class ShardedModel:
    """A model's bytes per GPU under FSDP2 with its decoder layers as units (mixed precision as in
    runtime/distributed.py: gathered in the compute dtype, gradients reduce-scattered in fp32 under bf16)."""

    shards: int  # the rank's shards: parameters, and for trainable ones their gradients and AdamW's two moments
    root: int  # the parameters outside the decoder layers, gathered for the whole step, with unsharded gradients
    layers: tuple[tuple[int, int], ...]  # per decoder layer: its gathered parameters, its unsharded gradient
    resident: int  # the model's bytes already allocated (none for a model built on the meta device)

    @classmethod
    def of(cls, model, world: int, bf16: bool) -> ShardedModel:
        """Counted from `model`'s parameters (tied ones once); a gradient is counted twice, in the compute dtype
        and as the reduce-scatter's input (fp32 under bf16)."""

        def gathered(params) -> tuple[int, int]:
            each = [fsdp_param_bytes(p, bf16) for p in params]
            return sum(e[1] for e in each), sum(e[2] for e in each)

        params = list(model.parameters())
        layers = [list(layer.parameters()) for layer in decoder_layers(model)]
        in_layers = {id(p) for ps in layers for p in ps}
        return cls(
            shards=sum(fsdp_param_bytes(p, bf16)[0] for p in params) // world,
            root=sum(gathered([p for p in params if id(p) not in in_layers])),
            layers=tuple(gathered(ps) for ps in layers),
            resident=resident_bytes(params),
        )

    def state_bytes(self, k: int) -> int:
        """What units of `k` consecutive layers (the last group shorter, as `engines.layer_groups` splits
        them) allocate beside the resident model: the shards, the root unit, two of the largest group gathered
        and its gradient."""
        groups = [self.layers[i : i + k] for i in range(0, len(self.layers), k)]
        full = max((sum(f for f, _ in g) for g in groups), default=0)
        grad = max((sum(g_ for _, g_ in g) for g in groups), default=0)
        return max(0, self.shards + self.root + 2 * full + grad - self.resident)


def resident_bytes(params) -> int:
    """The bytes of `params` already allocated where the model runs: all of them for a model loaded whole, none for
    one built on the meta device, whose only parameters with values then (a LoRA adapter, drawn on the host over
    the meta base) are written anew as shards on the GPU by the fill after `fully_shard`."""
    params = list(params)
    if any(p.is_meta for p in params):
        return 0
    return sum(nf4.nbytes(p) for p in params)  # a QLoRA base's NF4 weights as they are held (4 bits a value)


def dequantized_bytes(params) -> int:
    """The transient a QLoRA base adds to a step (ops/nf4.py): its largest NF4 weight dequantised to bf16 and cast
    for the matmul, in the forward and again in the backward (one at a time); 0 without an NF4 weight."""
    return 2 * max((p.numel() * 2 for p in params if nf4.is_nf4(p)), default=0)


@dataclass(frozen=True)
class GroupFit:
    k: int  # layers per unit: the largest that fits, 1 when none does
    need: int  # the step's estimated bytes with units of k layers
    over: int | None = None  # with k == 1: the estimate of 2 layers per unit, which did not fit (None: no 2nd layer)


def fsdp_group(
    sharded: ShardedModel,
    shapes: ActivationShapes,
    tokens: int,
    *,
    bf16: bool,
    fused_loss: bool,
    checkpointing: bool,
    available: int,
) -> GroupFit:
    """The most layers per FSDP2 unit (1 <= K < the layer count) whose step (`step_bytes` with `checkpointing`,
    at micro-batches of `tokens` tokens, beside `ShardedModel.state_bytes(K)`) fills at most FIT_SHARE of
    `available`; K is then evened out to the fewest layers that make as few units (32 layers at most 20 per unit:
    2 units of 16, the same collectives for less memory)."""

    def need(k: int) -> int:
        est = step_bytes(shapes, tokens, bf16=bf16, fused_loss=fused_loss, state_bytes=sharded.state_bytes(k))
        return est.with_checkpointing if checkpointing else est.without

    n, room = len(sharded.layers), FIT_SHARE * available
    most = next((k for k in range(n - 1, 1, -1) if need(k) <= room), None)
    if most is None:
        return GroupFit(1, need(1), need(2) if n > 2 else None)
    even = -(-n // -(-n // most))  # the fewest layers per unit that still make ceil(n / most) units
    k = even if need(even) <= room else most  # (a window of layers may straddle heavier ones: keep what fitted)
    return GroupFit(k, need(k))


# Bytes per trainable parameter of each optimizer's two moments (runtime/optim.py): AdamW's in fp32 (8; in the
# parameter's dtype, as torch holds them), torchao's 8-bit (2, plus a fp32 scale per block of 256: ~0.03; tensors
# under 4096 values, or not a multiple of 256, keep fp32 moments), torchao's bf16 AdamW (4, its moments bf16).
OPTIM_STATE_BYTES = {"adamw": 8, "adamw_8bit": 2, "adamw_bf16_sr": 4}
MASTER_BYTES = 4  # MasterAdamW's fp32 master of a bf16 weight (runtime/masters.py), and its fp32 gradient
# torchao's 8-bit states (`torchao.optim.AdamW8bit`): uint8 codes, a fp32 scale per block and a 256-entry fp32 map,
# for tensors of at least QUANT_MIN values that are a multiple of the block (bitsandbytes' rule); others plain.
QUANT_BLOCK, QUANT_MIN = 256, 4096


def optimizer_bytes(optim: str, n: int, param_bytes: int, masters: bool) -> int:
    """Bytes beside `n` trainable weights of `param_bytes` each: their gradients and the optimizer's state (with
    `masters`: fp32 gradients and masters, moments in fp32)."""
    if masters:
        return n * (2 * MASTER_BYTES + OPTIM_STATE_BYTES["adamw"])
    moments = OPTIM_STATE_BYTES[optim] * param_bytes // 4 if optim == "adamw" else OPTIM_STATE_BYTES[optim]
    return n * (param_bytes + moments)


def optimizer_state(optim: str, p, masters: bool) -> dict:
    """What the optimizer `optim` holds for parameter `p` once it has stepped, as meta tensors of its shapes and
    dtypes (what a checkpoint saves of it; `disk.state_bytes` sizes them): a step count and two moments, typed
    as `p` (torch's AdamW; torchao's bf16 AdamW over bf16 weights), fp32 with a fp32 master for a weight that is
    not fp32 under `masters` (MasterAdamW), or 8-bit codes with their block scales and map (`adamw_8bit`, for
    tensors it quantises). Under FSDP2, the rank's shard of `p` (a DTensor's local tensor)."""
    p = p.to_local() if hasattr(p, "to_local") else p

    def like(dtype, numel=None):
        return torch.empty(p.shape if numel is None else (numel,), dtype=dtype, device="meta")

    state = {"step": torch.empty((), dtype=torch.float32, device="meta")}
    n = p.numel()
    if optim == "adamw_8bit" and n >= QUANT_MIN and n % QUANT_BLOCK == 0:
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = {
                "codes": like(torch.uint8),
                "scale": like(torch.float32, n // QUANT_BLOCK),
                "qmap": like(torch.float32, 256),
            }
        return state
    lifted = masters and optim == "adamw" and p.dtype != torch.float32
    dtype = torch.float32 if lifted else p.dtype
    state["exp_avg"], state["exp_avg_sq"] = like(dtype), like(dtype)
    if lifted:
        state["master"] = like(torch.float32)
    return state


def nf4_bytes(numel: int) -> int:
    """The bytes a weight of `numel` values takes in NF4 (ops/nf4.py): 4-bit codes, an 8-bit scaler per block of
    64, a fp32 factor per group of scalers, the 16-value table; the estimate of a base not yet quantised."""
    return numel // 2 + numel // nf4.BLOCK + 4 * max(1, numel // (nf4.BLOCK * nf4.SCALER_BLOCK)) + 68
