"""Every `auto` setting of a run, resolved once: one frozen `Choices` with the reason for each value.

`measure` (runtime/measure.py) reads the device, the processes, the model and the data into `Facts`; every function
here is pure: config and facts in, values with reasons out, or `ConfigError` for settings that do not go together. The
trainer calls `measure`, then `resolve`, logs the choices (a line each, with its warnings, which travel in its `Choice`) and acts
on the values. Each choice may read those before it:

    device, bf16 -> threads -> compile -> compile_regions -> pack_layout -> cuda_graphs -> loss -> checkpointing
    -> keep_mixer_cores -> fsdp_units

Checkpointing is decided on the least FSDP2 units the run gets; the units then grow into the memory that choice
leaves (runtime/memory.py). What each choice reads: docs/INTERNALS.md.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridtune.config import TrainConfig
from hybridtune.data.collator import StaticLayout
from hybridtune.errors import ConfigError
from hybridtune.mixers import MIXERS, registry
from hybridtune.runtime.facts import Choice, Choices, Facts
from hybridtune.runtime.memory import FIT_SHARE, GIB, decide_checkpointing, fsdp_group, step_bytes
from hybridtune.runtime.memory_fit import choose_memory

# Estimated share of the step the filler costs (`FillerShares.cost`: tokens, and the mixers' metadata rows
# weighted by their kernels' share) above which `pack_layout: auto` stays dynamic (the static graph's compile-time
# and CUDA-graph gains are not worth more compute per step), and the cap for an explicit `static`.
AUTO_MAX_FILLER = 0.10
STATIC_MAX_FILLER = 0.50
# On the CPU, a model below this many parameters has ops too small to split over threads: extra threads only add
# synchronisation (OpenMP threads spin-wait for a busy core).
SMALL_MODEL_PARAMS = 50_000_000
# The share of a GPU's memory the whole-model FSDP2 unit's own bytes (`engines.whole_model_bytes`) may take;
# the rest is for activations and the allocator.
WHOLE_MODEL_SHARE = 0.7
# The most CUDA graphs `cuda_graphs: auto` lets one compiled graph record: one per distinct mixer size of the
# static layout's packs, all held in the graphs' memory pool for the run.
MAX_CUDA_GRAPHS = 64


def pick_device(name: str) -> torch.device:
    """The device of `device: auto | cpu | cuda` (under torchrun, `distributed.init` has selected the rank's GPU)."""
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for but no CUDA GPU is visible; use --device cpu")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def choose_bf16(cfg: TrainConfig, facts: Facts) -> Choice:
    if cfg.bf16 is True:
        return Choice(True, "bf16: true")
    if cfg.bf16 is False:
        return Choice(False, "bf16: false")
    if facts.device == "cuda" and facts.bf16_supported:
        return Choice(True, "auto: the GPU computes in bf16")
    return Choice(False, f"auto: fp32 on {'a GPU without bf16' if facts.device == 'cuda' else 'the CPU'}")


def choose_threads(cfg: TrainConfig, facts: Facts) -> Choice:
    if cfg.num_threads:
        return Choice(cfg.num_threads, "num_threads")
    if facts.device == "cpu" and facts.n_params < SMALL_MODEL_PARAMS:
        return Choice(1, f"auto: a {facts.n_params / 1e6:.1f}M-parameter model's CPU ops are too small to split")
    return Choice(None, "auto: torch's default")


def _whole_model_too_big(cfg: TrainConfig, facts: Facts) -> str | None:
    """Why the whole model as one FSDP2 unit would not leave room for activations (units of layers), or None."""
    share = facts.whole_model_share
    if facts.engine != "fsdp" or cfg.fsdp_units != "auto" or share is None or share <= WHOLE_MODEL_SHARE:
        return None
    return (
        f"the whole model as one FSDP2 unit needs {share:.0%} of the smallest GPU before activations, "
        f"more than {WHOLE_MODEL_SHARE:.0%}"
    )


def choose_compile(cfg: TrainConfig, facts: Facts) -> Choice:
    """`compile: auto` is the loop on a GPU and off on the CPU. The loop's one graph cannot hold FSDP2's per-layer
    hooks: for those, auto is the per-class `modules`, and an explicit `loop` with them is refused (a whole-model
    unit too big for auto is kept, with a warning). An MoE router loss is recorded inside the loop's graph."""
    warns: list[str] = []
    why = None
    per_layer = facts.engine == "fsdp" and cfg.fsdp_units not in ("auto", "model")  # layer or group:K
    too_big = _whole_model_too_big(cfg, facts)
    if too_big and cfg.compile == "loop":
        warns.append(f"{too_big}; compile: loop keeps it one unit (fsdp_units: layer would shard per layer)")
    elif too_big:
        per_layer, why = True, f"{too_big} (fsdp_units: auto -> layer or group:K)"
    if cfg.compile == "loop" and per_layer:
        raise ConfigError(
            f"config keys 'fsdp_units' = '{cfg.fsdp_units}' and 'compile' = 'loop' do not go together: the loop is "
            "one graph over every layer and FSDP2's per-unit hooks cannot run inside it; use compile: modules (or "
            "auto), or fsdp_units: model"
        )
    if cfg.compile != "auto":
        return Choice(cfg.compile, f"compile: {cfg.compile}", tuple(warns))
    if facts.device != "cuda":
        return Choice("off", "auto: no compile on the CPU")
    if per_layer:
        why = why or f"FSDP2 shards per decoder layer or group of layers (fsdp_units: {cfg.fsdp_units})"
    if why:
        return Choice("modules", f"auto: {why}, which the one-graph loop cannot hold")
    return Choice("loop", "auto: the whole decoder loop as one graph on the GPU")


def choose_fsdp_units(
    cfg: TrainConfig,
    facts: Facts,
    strategy: str,
    layout: StaticLayout | None = None,
    bf16: bool = False,
    fused: bool = True,
    checkpointing: bool = False,
) -> Choice:
    """`fsdp_units: auto` is the whole model under the compiled loop (one graph over every layer); otherwise the
    most consecutive layers per unit whose step fits the GPU's free memory (`memory.fsdp_group`: fewer, larger
    units are fewer collectives and FSDP2 hooks), one layer each where nothing larger fits or nothing can be
    estimated (the CPU); nothing without FSDP2."""
    if facts.engine != "fsdp":
        return Choice(None, "no FSDP2")
    if cfg.fsdp_units != "auto":
        return Choice(cfg.fsdp_units, f"fsdp_units: {cfg.fsdp_units}")
    if strategy == "loop":
        return Choice("model", "auto: the compiled loop is one graph over every layer")
    why = _whole_model_too_big(cfg, facts) or f"compile {strategy} leaves the layers to FSDP2's hooks"
    free, shapes, sharded = facts.gpu_free_bytes, facts.shapes, facts.sharded
    if free is None or sharded is None or shapes is None or not shapes.layer_types or not shapes.hidden:
        return Choice("layer", f"auto: {why}; no GPU memory to plan larger units for (fsdp_units: auto -> layer)")
    fit = fsdp_group(
        sharded, shapes, _largest_tokens(cfg, facts, layout), bf16=bf16, fused_loss=fused,
        checkpointing=checkpointing, available=free,
    )  # fmt: skip
    ckpt = "with" if checkpointing else "without"
    of = f"of the {free / GIB:.1f} GiB free per GPU ({ckpt} checkpointing)"
    if fit.k > 1:
        return Choice(f"group:{fit.k}", f"auto: {why}; {fit.k} layers per unit: about {fit.need / GIB:.1f} GiB {of}")
    larger = "" if fit.over is None else f", 2 would need {fit.over / GIB:.1f} GiB"
    return Choice("layer", f"auto: {why}; 1 layer per unit: about {fit.need / GIB:.1f} GiB {of}{larger}")


def least_units(cfg: TrainConfig, facts: Facts, strategy: str) -> int | None:
    """Under FSDP2, the fewest layers per unit the run will get (None: the whole model as one unit): the explicit
    units, or under auto the whole model with the loop and one layer otherwise (`choose_fsdp_units` only grows
    them); None without FSDP2."""
    units = cfg.fsdp_units
    if facts.engine != "fsdp" or units == "model" or (units == "auto" and strategy == "loop"):
        return None
    return int(units.partition(":")[2]) if units.startswith("group:") else 1


def choose_pack_layout(cfg: TrainConfig, facts: Facts, strategy: str) -> Choice:
    """Static (every batch filled to one size fitted over every train and eval pack of the run) under
    `pack_layout: static`, or `auto` under a compile (the loop, or the per-class forwards, which then compile once
    per class) when the fit costs at most AUTO_MAX_FILLER of the step; dynamic otherwise. A router loss counts only
    the bins' own tokens (the step masks the filler out of its statistics)."""
    if cfg.pack_layout == "dynamic":
        return Choice(None, "pack_layout: dynamic")
    if cfg.pack_layout == "auto" and strategy not in ("loop", "modules"):
        return Choice(None, f"auto: without a compile (compile {strategy})")
    if cfg.micro_batch_size > 1:
        if cfg.pack_layout == "static":
            raise ConfigError(
                "pack_layout 'static' needs micro_batch_size 1 (a micro-batch of several bins is collated as "
                "one pack); raise gradient_accumulation_steps instead, or use pack_layout: dynamic"
            )
        return Choice(None, "auto: micro_batch_size > 1, and the static layout fits single bins")
    packs = [list(p) for p in facts.packs]
    limit = AUTO_MAX_FILLER if cfg.pack_layout == "auto" else STATIC_MAX_FILLER
    layout = StaticLayout.fit(packs, max_filler=limit) if packs else None
    if layout is None:
        why = f"the filler of any static layout for these packs would cost more than {limit:.0%} of the step"
        if cfg.pack_layout == "static":
            raise ConfigError(f"pack_layout 'static': {why}; use pack_layout: dynamic (or auto)")
        return Choice(None, f"auto: {why}")
    shares = layout.filler_shares(packs)
    return Choice(
        layout,
        f"{'auto' if cfg.pack_layout == 'auto' else 'pack_layout: static'}: filler {100 * shares.tokens:.1f}% of "
        f"the tokens, {_size_shares(shares.sizes)}about {100 * shares.cost:.1f}% of the step",
    )


def _size_shares(sizes: dict[str, float]) -> str:
    return "".join(f"{100 * v:.1f}% of the {MIXERS[k].size_name or k + ' row'}s, " for k, v in sizes.items())


def cuda_graph_keys(layout: StaticLayout, packs) -> set[tuple[int, ...]]:
    """The distinct mixer metadata sizes (`mixers.registry.size_key`: a chunked mixer's chunk count) of these packs
    under `layout`, filler included: a compiled graph of the static layout records one CUDA graph per key (T and N
    are fixed, only those sizes vary)."""
    return {registry.size_key((*p, *layout.filler(p))) for p in packs}


def _size_names() -> str:
    return " x ".join(s.size_name or f"{s.kind} row" for s in MIXERS.values() if s.size is not None) + " counts"


def choose_cuda_graphs(cfg: TrainConfig, facts: Facts, strategy: str, layout: StaticLayout | None) -> Choice:
    """`cuda_graphs: auto` records the compiled loop's kernels as CUDA graphs (torch.compile's
    "reduce-overhead") when one process runs the loop on a GPU over a static layout, and the layout's packs need
    at most MAX_CUDA_GRAPHS graphs (one per distinct mixer size, `cuda_graph_keys`); an explicit `on` elsewhere is
    refused."""
    why = None
    if facts.device != "cuda":
        why = "CUDA graphs need a GPU"
    elif facts.engine != "none":
        why = f"{facts.world} processes ({facts.engine}): CUDA graphs run in one process"
    elif strategy != "loop":
        why = f"compile {strategy}: CUDA graphs record the compiled loop (compile: loop)"
    elif layout is None:
        why = "the dynamic pack layout changes the step's sizes every batch (CUDA graphs need pack_layout: static)"
    else:
        keys = cuda_graph_keys(layout, facts.packs)
        if len(keys) > MAX_CUDA_GRAPHS:
            why = (
                f"the static layout's packs have {len(keys)} distinct {_size_names()}, each a CUDA graph in the "
                f"pool: more than {MAX_CUDA_GRAPHS}"
            )
    if cfg.cuda_graphs == "off":
        return Choice(False, "cuda_graphs: off")
    if why is not None:
        if cfg.cuda_graphs == "on":
            raise ConfigError(f"cuda_graphs 'on': {why}; use cuda_graphs: auto (or off)")
        return Choice(False, f"auto: off: {why}")
    n = len(keys)
    return Choice(
        True,
        f"{'auto' if cfg.cuda_graphs == 'auto' else 'cuda_graphs: on'}: the compiled loop over the static layout in "
        f"one process, at most {n} graph{'s' * (n != 1)} per compiled graph (one per distinct {_size_names()})",
    )


def choose_compile_regions(cfg: TrainConfig, facts: Facts, strategy: str) -> Choice:
    """`compile_regions: auto` traces each distinct decoder layer once (compile_loop(regional=True)) when one
    process runs the loop: the same loss and gradients (CPU and CUDA tests, tests/compiler/test_loop_regions.py),
    the same step time and a shorter first step (measured: docs/INTERNALS.md). Under torchrun
    it stays off: the regional loop under DDP or FSDP2 has not been checked on GPUs."""
    if strategy != "loop":
        warns = []
        if cfg.compile_regions is True:
            warns.append(f"compile_regions: no effect under compile strategy '{strategy}' (regions are the loop's)")
        auto = "auto: " if cfg.compile_regions == "auto" else ""
        return Choice(False, f"{auto}no loop (compile {strategy})", tuple(warns))
    if cfg.load_in_4bit:  # torch's regions (the invoke_subgraph HOP) take no tensor subclass such as NF4 weights
        warns = ("compile_regions: true has no effect under load_in_4bit",) if cfg.compile_regions is True else ()
        return Choice(False, "load_in_4bit: every layer inlined (torch's regions take no NF4 weight yet)", warns)
    if cfg.compile_regions != "auto":
        warns = []
        if cfg.compile_regions is True and facts.engine != "none":
            warns.append(f"compile_regions: true under {facts.engine}: the regional loop is not yet checked there")
        return Choice(bool(cfg.compile_regions), f"compile_regions: {str(cfg.compile_regions).lower()}", tuple(warns))
    if facts.engine != "none":
        return Choice(False, f"auto: off under {facts.engine} ({facts.world} processes): not yet checked there")
    return Choice(True, "auto: each distinct decoder layer traced once for the loop in one process")


def choose_loss(cfg: TrainConfig, facts: Facts) -> Choice:
    if cfg.loss == "plain":
        return Choice(False, "loss: plain, transformers' own ([tokens, vocab] logits kept)")
    if facts.fused_loss_blocker is None:
        return Choice(True, "fused chunked cross-entropy against lm_head, no [tokens, vocab] logits kept")
    if cfg.loss == "fused":
        raise ConfigError(
            f"loss 'fused' cannot stand in for this model's loss: {facts.fused_loss_blocker}; use loss: auto or plain"
        )
    return Choice(False, f"auto: transformers' own loss ([tokens, vocab] logits kept): {facts.fused_loss_blocker}")


def _largest_tokens(cfg: TrainConfig, facts: Facts, layout: StaticLayout | None) -> int:
    """Tokens of the largest micro-batch the run collates (the static layout's size when it has one)."""
    tokens = max([cfg.sequence_len * cfg.micro_batch_size] + [sum(p) for p in facts.packs])
    return max(tokens, layout.tokens) if layout is not None else tokens


def _estimate(cfg: TrainConfig, facts: Facts, layout, bf16: bool, fused: bool, units: int | None):
    """(tokens of the largest micro-batch, `memory.step_bytes` for it)."""
    tokens = _largest_tokens(cfg, facts, layout)
    state = facts.state_bytes if units is None or facts.sharded is None else facts.sharded.state_bytes(units)
    return tokens, step_bytes(facts.shapes, tokens, bf16=bf16, fused_loss=fused, state_bytes=state)


def choose_keep_mixer_cores(
    cfg: TrainConfig, facts: Facts, strategy: str, checkpointing: bool, layout, bf16: bool, fused: bool
) -> Choice:
    """`keep_mixer_cores: auto` under checkpointing: the compiled loop's checkpoints keep the mixers' cores
    (compiler/recompute.py; the same loss and gradients, the kept cores' forward not run again) in one
    process when the memory estimate with them kept fits the free memory; they are recomputed otherwise.
    True: kept (`compile_loop(keep_cores=True)`)."""
    if strategy != "loop":
        auto = "auto: " if cfg.keep_mixer_cores == "auto" else ""
        warns = []
        if cfg.keep_mixer_cores is True:
            warns.append(f"keep_mixer_cores: true has no effect under compile strategy '{strategy}' (the loop's)")
        return Choice(False, f"{auto}compile {strategy}: only the loop keeps them", tuple(warns))
    if cfg.keep_mixer_cores != "auto":  # (also for the checkpointing an out-of-memory retry may switch on)
        unchecked = f"; not yet checked under {facts.engine}" if facts.engine != "none" and cfg.keep_mixer_cores else ""
        return Choice(bool(cfg.keep_mixer_cores), f"keep_mixer_cores: {str(cfg.keep_mixer_cores).lower()}{unchecked}")
    if not checkpointing:
        return Choice(False, "no checkpointing: nothing is recomputed")
    if facts.engine != "none":
        return Choice(False, f"auto: recomputed under {facts.engine}: keeping them is not yet checked there")
    if facts.device != "cuda" or facts.gpu_free_bytes is None or facts.shapes is None or not facts.shapes.hidden:
        return Choice(False, "auto: recomputed, no GPU memory to plan for")
    tokens, est = _estimate(cfg, facts, layout, bf16, fused, None)
    need, free = est.keeping_cores / GIB, facts.gpu_free_bytes / GIB
    if est.keeping_cores <= FIT_SHARE * facts.gpu_free_bytes:
        return Choice(
            True, f"auto: kept: {tokens}-token micro-batches need about {need:.1f} GiB so; {free:.1f} GiB free"
        )
    return Choice(False, f"auto: recomputed: keeping them would need about {need:.1f} GiB; {free:.1f} GiB free")


def choose_checkpointing(
    cfg: TrainConfig,
    facts: Facts,
    layout: StaticLayout | None = None,
    bf16: bool = False,
    fused: bool = True,
    units: int | None = None,
) -> Choice:
    """`gradient_checkpointing: auto` on a GPU: on when the memory estimate of a micro-batch without it
    (runtime/memory.py, at the largest pack the run collates) would not fit the free memory, off otherwise; where
    nothing can be estimated (the CPU), off. Off under auto is switched on if the first step runs out of memory.
    `units`: FSDP2's layers per unit (`least_units`), whose state replaces the whole-model unit's (None)."""
    if cfg.gradient_checkpointing != "auto":
        return Choice(bool(cfg.gradient_checkpointing), f"gradient_checkpointing: {cfg.gradient_checkpointing}")
    retry = "switched on if the first step runs out of GPU memory"
    if facts.engine != "none":  # runtime/oom.py retries in one process only
        retry = f"a first step out of GPU memory stops with the setting to change ({facts.engine}: no retry)"
    if facts.device != "cuda" or facts.gpu_free_bytes is None or facts.shapes is None:
        return Choice(False, f"auto: off, no GPU memory to plan for; {retry}")
    if not facts.shapes.layer_types or not facts.shapes.hidden:
        return Choice(False, f"auto: off, the model's layer widths are unknown; {retry}")
    tokens, est = _estimate(cfg, facts, layout, bf16, fused, units)
    d = decide_checkpointing(est, facts.gpu_free_bytes, tokens)
    reason = d.reason if d.on else f"{d.reason}; {retry}"
    return Choice(d.on, reason, (d.warning,) if d.warning else ())


def resolve(cfg: TrainConfig, facts: Facts) -> Choices:
    """Every choice of the run from the config and the facts (see the module docstring)."""
    compile_ = choose_compile(cfg, facts)
    bf16 = choose_bf16(cfg, facts)
    if cfg.bf16 is True and facts.device == "cpu":
        cpu = "bf16 on CPU autocasts matmuls only and is slow on most CPUs; fp32 is the CPU default"
        bf16 = dataclasses.replace(bf16, warnings=(*bf16.warnings, cpu))
    layout = choose_pack_layout(cfg, facts, compile_.value)
    fused = choose_loss(cfg, facts)
    units = least_units(cfg, facts, compile_.value)
    checkpointing = choose_checkpointing(cfg, facts, layout.value, bf16.value, fused.value, units)
    fsdp_units = choose_fsdp_units(
        cfg, facts, compile_.value, layout.value, bf16.value, fused.value, checkpointing.value
    )
    cores = choose_keep_mixer_cores(
        cfg, facts, compile_.value, checkpointing.value, layout.value, bf16.value, fused.value
    )
    return Choices(
        bf16=bf16,
        threads=choose_threads(cfg, facts),
        compile=compile_,
        fsdp_units=fsdp_units,
        pack_layout=layout,
        cuda_graphs=choose_cuda_graphs(cfg, facts, compile_.value, layout.value),
        compile_regions=choose_compile_regions(cfg, facts, compile_.value),
        fused_loss=fused,
        checkpointing=checkpointing,
        keep_mixer_cores=cores,
        memory=choose_memory(
            cfg, facts, _largest_tokens(cfg, facts, layout.value), bf16.value, fused.value, checkpointing.value
        ),
    )
