"""What a run will write, estimated before it trains and set against the free space of output_dir's disk.

- Sizes. A resume checkpoint is what `checkpoint.save_checkpoint` writes (`checkpoint.state_estimate`: the weights
  DCP saves and what the optimizer holds per trainable parameter: two moments, MasterAdamW's fp32 masters, torchao's
  8-bit codes and scales) plus its tokenizer; the final model is what `export.save_final` writes, sized by
  export's own functions (the source's dtype, an adapter, a preset's base).
- Count. `save_total_limit` checkpoints are kept, and one more exists while the next is written (pruning follows a
  save). A resumed run's own checkpoints are on the disk already; the earlier run's, which a fresh run removes
  before training (`outdir.tidy`), give their room back.
- Plan (`fit_run`: rank 0's disk, the same plan on every rank). If everything fits, one line gives the figures.
  If not even final/ fits, the run is refused in one line (DiskFullError, exit 2) before anything is written.
  Otherwise the run is fitted to the disk and a warning says how: fewer checkpoints kept (a lower
  save_total_limit), or the periodic saves skipped (save_steps 0), so that final/ is written at the end.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from pathlib import Path

import torch

from hybridtune.config import TrainConfig
from hybridtune.models import source
from hybridtune.models.anatomy import unwrap
from hybridtune.models.loading import LoadedModel
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import export, guarded
from hybridtune.run.disk import DiskFullError, gib
from hybridtune.runtime import distributed
from hybridtune.runtime.adapter_kind import AdapterKind, adapter_kind
from hybridtune.runtime.distributed import Dist
from hybridtune.runtime.optim import optim_name, uses_masters

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Room:
    checkpoint: int  # bytes of one resume checkpoint
    final: int  # bytes of the final model (final/, and base_model/ beside a preset's adapter)
    free: int  # free bytes on output_dir's disk now
    where: Path  # where that was asked
    freed: int = 0  # bytes of the earlier run's checkpoints, removed before training
    existing: int = 0  # checkpoints of this run already there (a resume), which count towards save_total_limit


def periodic_saves(start: int, total: int, save_steps: int) -> range:
    """The steps after `start` whose periodic save runs (the last step's is the end-of-run save instead).

    >>> list(periodic_saves(0, 10, 3)), list(periodic_saves(3, 9, 3)), len(periodic_saves(0, 1000, 100))
    ([3, 6, 9], [6], 9)
    """
    if not save_steps or total <= start + 1:
        return range(0)
    return range((start // save_steps + 1) * save_steps, total, save_steps)


def need(room: Room, saves: int, limit: int) -> int:
    """The most bytes the run adds to the disk at any moment: while a checkpoint is written beside those kept (at
    most `limit`, pruned after each save), and at the end, the checkpoints kept and the final model."""
    if saves == 0:
        return room.final
    e = room.existing
    during = max(e + 1, min(e + saves - 1, limit) + 1) - e
    after = min(e + saves, limit) - e
    return max(during * room.checkpoint, after * room.checkpoint + room.final)


def _steps(steps: range) -> str:
    shown = ", ".join(map(str, steps)) if len(steps) <= 4 else f"{steps[0]}, {steps[1]}, ..., {steps[-1]}"
    return f"step{'s' if len(steps) > 1 else ''} {shown}"


def plan(room: Room, limit: int, save_steps: int, start: int, total: int) -> tuple[int, int, str, str | None]:
    """(save_total_limit, save_steps, the line of figures, a warning or None) of a run from step `start` to
    `total` on `room`; DiskFullError when not even the final model fits."""
    periodic = periodic_saves(start, total, save_steps)
    end = 1 if total > start else 0
    saves = len(periodic) + end
    kept = min(room.existing + saves, limit) if saves else room.existing
    writing = " (+1 while the next is written)" if room.existing + saves > limit else ""
    avail = room.free + room.freed
    back = f" (+{gib(room.freed)} as the earlier run's checkpoints are cleared first)" if room.freed else ""
    line = (
        f"disk: a checkpoint ~{gib(room.checkpoint)} x {kept} kept{writing} + final ~{gib(room.final)}; "
        f"{gib(room.free)} free at '{room.where}'{back}"
    )
    if need(room, saves, limit) <= avail:
        return limit, save_steps, line, None
    if room.final > avail:
        raise DiskFullError(
            f"disk full: this run's final model alone needs about {gib(room.final)} (each checkpoint ~"
            f"{gib(room.checkpoint)} more) and '{room.where}' has {gib(room.free)} free{back}; nothing was written. "
            "Free some space or use an output_dir on a larger disk",
            room.final,
            avail,
        )
    short = f"the checkpoints do not all fit ({gib(need(room, saves, limit))} at most, {gib(avail)} free)"
    for every, n in ((save_steps, saves), (0, end)):
        for fewer in range(min(limit, room.existing + n), 0, -1):
            if need(room, n, fewer) > avail:
                continue
            fewer = limit if fewer >= room.existing + n else fewer  # nothing is pruned either way: kept as set
            how = [f"save_total_limit {limit} -> {fewer}"] if fewer < limit else []
            if every != save_steps:
                how.append(f"save_steps {save_steps} -> 0: the periodic saves ({_steps(periodic)}) are skipped")
            return fewer, every, line, (
                f"{short}: for this run {'; '.join(how)}; final/ (the trained model) is written at the end, with "
                "the last step's checkpoint"
            )  # fmt: skip
    skipped = (
        f"the periodic saves ({_steps(periodic)}) are skipped (save_steps {save_steps} -> 0); " if periodic else ""
    )
    if room.checkpoint > avail:
        then = "no checkpoint fits: the last step's is refused when it comes and final/ (the trained model) written "
        then += "instead; a stopped run cannot be resumed"
    else:
        then = (
            f"the last step's checkpoint fits but final/ will not fit beside it: the run will end with that checkpoint "
            f"alone (exit 2; `hybridtune export` writes final/ from it elsewhere) unless "
            f"{gib(room.checkpoint + room.final - avail)} more is freed"
        )
    return limit, 0 if periodic else save_steps, line, f"{short}: {skipped}{then}"


def final_bytes(model: torch.nn.Module, kind: AdapterKind, loaded: LoadedModel, tokenizer, d: Dist) -> int:
    """What `export.save_final` writes, by its own size functions: the adapter (and a preset's base weights, written
    beside it) or the full model in the source's dtype (at least the source's own weight files), each with its
    tokenizer. A collective under FSDP2, whose ranks each hold a shard."""
    tok = export.tokenizer_bytes(tokenizer)
    if kind.lora:
        from peft import get_peft_model_state_dict  # (export.py's own import: for an adapter only)

        n = export.tensor_bytes(get_peft_model_state_dict(model)) + tok
        if loaded.source_dir is None:
            n += export.tensor_bytes(export.unwrapped_base_state(model.get_base_model())) + tok
    else:
        n = export.tensor_bytes(unwrap(model).state_dict(), loaded.source_dtype)
    if d.engine == "fsdp":
        n = int(distributed.all_sum([float(n)], d)[0])
    return n if kind.lora else max(n, source.weight_bytes(loaded.source_dir)) + tok


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):  # links are not followed
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def measure(out: Path, checkpoint: int, final: int, start: int) -> Room:
    """The room in `out` for a run from step `start` (0: a fresh run, whose removal of the earlier run's
    checkpoints frees their bytes; else a resume, whose checkpoints up to `start` stay)."""
    where = guarded.free_space_at(out)
    ours = [p for p in ckpt.list_checkpoints(out) if ckpt.is_ours(p)] if out.is_dir() else []
    stay = [p for p in ours if start and ckpt.step_of(p) <= start]
    freed = sum(_dir_bytes(p) for p in ours if p not in stay)
    return Room(checkpoint, final, shutil.disk_usage(where).free, where, freed, len(stay))


def fit_run(
    cfg: TrainConfig, engine: torch.nn.Module, built, tokenizer, start: int, total: int, d: Dist
) -> TrainConfig:
    """`cfg` fitted to the free space of output_dir's disk (module docstring): the same, or with fewer checkpoints
    kept or its periodic saves skipped, a warning saying which; DiskFullError (one line, exit 2) when not even the
    final model fits. Every rank calls it (the sizes are collectives under torchrun); rank 0 decides for all."""
    params = [p for p in engine.parameters() if p.requires_grad]
    kind = adapter_kind(cfg)
    # MasterAdamW's fp32 masters are made for the weights computed in bf16 (masters.split: a full fine-tune's
    # trainable weights are fp32 otherwise), as `uses_masters` decides under bf16.
    masters = uses_masters(cfg, any(p.dtype == torch.bfloat16 for p in params), d)
    state = ckpt.state_estimate(
        engine, params, d, trainable_only=kind.trainable_only, optim=optim_name(cfg), masters=masters
    )
    checkpoint = state + export.tokenizer_bytes(tokenizer)
    final = final_bytes(built.model, kind, built.loaded, tokenizer, d)

    def decide() -> tuple[int, int]:
        try:
            room = measure(Path(cfg.output_dir), checkpoint, final, start)
        except OSError as e:
            logger.info("disk: the free space of output_dir is unknown (%s); saves check it when they come", e)
            return cfg.save_total_limit, cfg.save_steps
        limit, save_steps, line, warning = plan(room, cfg.save_total_limit, cfg.save_steps, start, total)
        logger.info("%s", line)
        if warning:
            logger.warning("%s", warning)
        return limit, save_steps

    limit, save_steps = distributed.main_only(d, decide)
    if (limit, save_steps) == (cfg.save_total_limit, cfg.save_steps):
        return cfg
    return dataclasses.replace(cfg, save_total_limit=limit, save_steps=save_steps)
