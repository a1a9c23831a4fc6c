"""The engines around `distributed.LossModule`: itself in one process, DDP, or FSDP2 on the units `fsdp_units` names.

`wrap` shards FSDP2's units (`layer_groups`: each decoder layer, `group:K` consecutive ones, or `model`: the root
alone, which the compiled loop needs), then the root, and chains each unit's all-gather prefetch; a model built on the
meta device is filled after `fully_shard`, each rank its own shards (`load_sharded`). `accumulation` holds a window's
gradient sync to its last micro-batch (DDP's `no_sync`; FSDP2's whole-model unit kept gathered). `whole_model_bytes`
and `whole_model_share` size the whole-model unit for `fsdp_units: auto`. Under bf16 the fp32 shards are the master
weights, all-gathered as bf16, their gradients reduce-scattered in fp32. The process group and the collectives:
runtime/distributed.py.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import sys
import warnings

import torch

from hybridtune.errors import ConfigError
from hybridtune.models.anatomy import decoder_layers
from hybridtune.models.loading import materialize
from hybridtune.runtime import distributed
from hybridtune.runtime.distributed import Dist, LossModule
from hybridtune.runtime.memory import fsdp_param_bytes

logger = logging.getLogger(__name__)


def load_sharded(loaded, engine: torch.nn.Module, d: Dist, device: torch.device) -> list[dict]:
    """Fill a model built on the meta device (`loaded.reader` set) after `wrap` sharded it: each rank gives its shards
    storage on `device` and reads (a checkpoint) or draws (a preset) only those. Logs, per rank, the bytes it holds
    of the model, the largest block it staged on the host, its peak host RSS and peak GPU memory; returns those
    records in rank order (every rank)."""
    stats = materialize(loaded, engine, device)
    rec = {
        "rank": d.rank,
        "local_bytes": stats.local_bytes,
        "model_bytes": stats.model_bytes,
        "staged_bytes": stats.staged_bytes,
        "host_peak_bytes": peak_rss_bytes(),
        "gpu_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0,
    }
    records = distributed.gather_objects(rec, d)
    mib, gib = 2.0**20, 2.0**30
    for r in records:
        logger.info(
            "sharded load: rank %d holds %.1f MiB of the model's %.1f MiB (largest host block %.1f MiB); "
            "peak host RSS %.2f GiB, peak GPU %.2f GiB",
            r["rank"],
            r["local_bytes"] / mib,
            r["model_bytes"] / mib,
            r["staged_bytes"] / mib,
            r["host_peak_bytes"] / gib,
            r["gpu_peak_bytes"] / gib,
        )
    return records


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def whole_model_bytes(model: torch.nn.Module, world: int, bf16: bool = True) -> int:
    """Bytes per GPU that FSDP2 with the whole model as one unit holds besides activations: the shards of the
    parameters, their gradients and AdamW's two moments (frozen parameters: the shard alone); the whole model
    gathered (in bf16 under mixed precision, else in its own dtype); over an optimizer step's window the whole
    fp32 gradient, and during a backward the gathered-dtype one. Tied parameters count once."""
    each = [fsdp_param_bytes(p, bf16) for p in model.parameters()]
    return sum(e[0] for e in each) // world + sum(e[1] + e[2] for e in each)


def whole_model_share(model: torch.nn.Module, d: Dist, device: torch.device, bf16: bool) -> float | None:
    """`whole_model_bytes` over the GPU's memory, the max over ranks (every rank must choose the same units: the
    tightest GPU decides); None off FSDP2 or off the GPU. A collective under FSDP2 on a GPU."""
    if d.engine != "fsdp" or device.type != "cuda":
        return None
    need = whole_model_bytes(model, d.world, bf16)
    return distributed.all_max(need / torch.cuda.get_device_properties(device).total_memory, d)


def wrap(runner: LossModule, d: Dist, device: torch.device, bf16: bool, loaded=None) -> torch.nn.Module:
    """`runner` as the engine of `d` sees it: itself in one process, DDP- or FSDP2-wrapped otherwise.

    `loaded` (a `models.loading.LoadedModel`) built on the meta device (`loaded.reader` set): filled here, after
    `fully_shard` under FSDP2 (each rank its own shards, `load_sharded`), whole before DDP or in one process.

    FSDP2 with `d.units == "model"` shards the root alone: parameters, gradients and optimizer state stay
    sharded between optimizer steps, and the whole model is gathered for the window's micro-batches. That
    is what the compiled `loop` needs: FSDP2's per-module hooks are `torch._dynamo.disable`d, so a layer
    sharded on its own would break the one graph of the decoder loop. With layer or group units, each unit
    prefetches the next one's all-gather explicitly (the previous one's in backward).
    """
    pending = loaded is not None and loaded.reader is not None
    if pending and d.engine != "fsdp":
        materialize(loaded, loaded.model, device)
    if not d.enabled:
        return runner
    if d.engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        # DDPOptimizer would split a compiled graph at bucket boundaries to overlap all-reduce with backward;
        # gradients here are synced once per window (no_sync on the others), so keep the loop one graph.
        torch._dynamo.config.optimize_ddp = False
        # Every trainable parameter takes part in every step; buffers (rotary tables) are the same on all ranks,
        # so none is broadcast per forward. (Newer torch renames the flag; the old name keeps torch 2.9-2.11.)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated")
            return DDP(runner, device_ids=ids, broadcast_buffers=False)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw = {"mp_policy": mp} if mp is not None else {}
    layers = decoder_layers(runner.model) if d.units != "model" else []
    groups = layer_groups(layers, d.units)
    for group in groups:
        fully_shard(group[0] if len(group) == 1 else group, **kw)
    fully_shard(runner, **kw)
    # Each unit's all-gather is issued when the unit before it (the root for the first) starts its forward, so it
    # runs while that one computes; in backward the other way round. A group's modules share one FSDP2 state.
    heads = [group[0] for group in groups]
    for before, head in zip([runner, *heads], heads):
        before.set_modules_to_forward_prefetch([head])
    for head, after in zip(heads, [*heads[1:], runner]):
        after.set_modules_to_backward_prefetch([head])
    if not groups:
        unit = "the whole model as one unit, gathered once and gradients reduce-scattered once per optimizer step"
    elif len(groups) == len(layers):
        unit = f"{len(layers)} decoder layers + the rest, gradients reduce-scattered every micro-batch"
    else:
        sizes = "/".join(str(len(g)) for g in groups)
        unit = (
            f"{len(groups)} groups of decoder layers ({sizes}) + the rest, gradients reduce-scattered every micro-batch"
        )
    logger.info("FSDP2: %s, over %d ranks%s", unit, d.world, " (bf16 params, fp32 reduce)" if mp else "")
    if pending:
        load_sharded(loaded, runner, d, device)
    return runner


def layer_groups(layers: list, units: str) -> list[list]:
    """The decoder layers as FSDP2 units: one each for `layer`, K consecutive ones for `group:K` (the last group
    shorter when K does not divide the layer count), none for `model`.

    >>> layer_groups(list("abcde"), "group:2"), layer_groups(list("ab"), "layer"), layer_groups(list("ab"), "model")
    ([['a', 'b'], ['c', 'd'], ['e']], [['a'], ['b']], [])
    """
    if units == "model":
        return []
    size = 1
    if units != "layer":
        kind, _, raw = units.partition(":")
        if kind != "group" or not raw.isdigit() or int(raw) < 1:
            raise ConfigError(f"FSDP2 units {units!r}: use layer, model or group:K with K a positive number of layers")
        size = int(raw)
    return [layers[i : i + size] for i in range(0, len(layers), size)]


@contextlib.contextmanager
def accumulation(engine: torch.nn.Module, d: Dist, last: bool):
    """Context for one micro-batch's forward + backward: gradients are reduced on the window's last one only,
    except under FSDP2 per layer.

    - DDP: `no_sync` on the earlier micro-batches.
    - FSDP2, `model` units: the earlier micro-batches keep the model gathered (no all-gather per micro-batch)
      and accumulate the unsharded gradient; the last one reduce-scatters it and reshards. The communication
      is then that of one micro-batch per step. The cost is memory: from the first micro-batch's backward to
      the last one's, the whole unsharded gradient is kept (fp32 under bf16 mixed precision: 4 bytes per
      parameter) through the next forwards, where activations peak.
    - FSDP2, `layer` (or `group:K`) units: every micro-batch reduce-scatters, so no layer's unsharded gradient
      outlives its backward (the memory `layer` is chosen for).

    An exception inside a window's earlier micro-batch puts FSDP2 back to reducing and resharding, so nothing
    after it (an eval, a save) runs with the model left gathered.
    """
    if d.engine == "ddp" and not last:
        with engine.no_sync():
            yield
        return
    windowed = d.engine == "fsdp" and d.units == "model"
    if windowed:
        _reduce_now(engine, last)
    try:
        yield
    except BaseException:
        if windowed and not last:
            _reduce_now(engine, True)
        raise


def _reduce_now(engine, on: bool) -> None:
    """Whether the whole-model FSDP2 unit's next backward reduce-scatters its gradient and reshards (off: keeps
    both gathered for the window's next micro-batch)."""
    engine.set_requires_gradient_sync(on, recurse=False)
    engine.set_reshard_after_backward(on, recurse=False)
