"""A run resumed from its checkpoint: which one (`find_resume`: the one named, or `latest`, the newest intact one,
each newer one skipped named with why) and its state loaded back (`load_checkpoint`: weights, optimizer, schedule,
each rank's RNG), every file verified first and checked against the run's config before training goes on.
The checkpoint format and its writing: run/checkpoint.py.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import torch

from hybridtune.run import integrity
from hybridtune.run.checkpoint import (
    META_FILE,
    RNG_FILE,
    STATE_DIR,
    STATE_FILE,
    is_ours,
    is_step_dir,
    list_checkpoints,
    load_trainer_state,
    meta_of,
    quiet_single_process,
    state_options,
    step_of,
    verify_checkpoint,
)
from hybridtune.run.integrity import CheckpointError
from hybridtune.run.rng import set_rng_state
from hybridtune.runtime import optim as optimizers
from hybridtune.runtime import optim_state
from hybridtune.runtime.distributed import ONE, Dist

logger = logging.getLogger("hybridtune")


def find_resume(where: str, output_dir: Path, d: Dist = ONE) -> tuple[Path, list[str]]:
    """The verified checkpoint to resume from, and one warning line per newer checkpoint skipped on the way.

    `where` is `latest` (the newest intact checkpoint of `output_dir`; newer ones that fail verification are
    skipped, each named with why) or the path of one checkpoint (which must be intact: no fallback, since the
    user named it). Raises CheckpointError, one line naming the file that failed. A collective.
    """
    if where != "latest":
        path = Path(where)
        if not path.is_dir():
            raise CheckpointError(f"resume_from_checkpoint '{where}': no such checkpoint directory")
        why = verify_checkpoint(path, d)
        if why:
            raise CheckpointError(f"resume_from_checkpoint '{where}' cannot be resumed: {why}")
        return path, []
    skipped: list[tuple[Path, str]] = []
    for path in reversed(_candidates(output_dir)):
        why = verify_checkpoint(path, d)
        if why is None:
            lines = [
                f"resume_from_checkpoint latest: skipped {p.name} ({why}); resuming from {path.name}"
                for p, why in skipped
            ]
            return path, lines
        skipped.append((path, why))
    if not skipped:
        raise CheckpointError(
            f"resume_from_checkpoint 'latest': no checkpoint in '{output_dir}' (the run stopped "
            "before its first save): run the same command without it, which starts the run again"
        )
    raise CheckpointError(
        f"resume_from_checkpoint 'latest': no intact checkpoint in '{output_dir}' ("
        + "; ".join(f"{p.name}: {why}" for p, why in skipped)
        + "); start a new run with --overwrite, or resume from a copy you trust"
    )


def _candidates(output_dir: Path) -> list[Path]:
    """Checkpoints `latest` considers, oldest first: the complete ones, and hybridtune's own that lost their
    checkpoint.json (named when skipped, not silently passed over)."""
    out = [p for p in Path(output_dir).glob("checkpoint-*") if is_step_dir(p) and is_ours(p)]
    return sorted(set(out) | set(list_checkpoints(output_dir)), key=step_of)


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    d: Dist = ONE,
    trainable_only: bool = False,
    verified: bool = False,
) -> dict:
    """Load weights, optimizer, scheduler and this rank's RNG from checkpoint `path` (written by any number of
    processes); returns the trainer state (`step`, `data_position`, `world`).

    The checkpoint is verified first unless `verified` (it came from `find_resume`); nothing in it is unpickled
    beyond tensors, plain values and DCP's metadata classes. Raises CheckpointError naming the file.

    The run's config is the truth for the hyperparameters, not the files (checksums prove a file is the one its
    checkpoint.json lists, not who wrote both: an edited lr with its checksums redone passed them). A loaded rate or
    weight decay that the checkpoint's run record also gives is a config changed since (--overwrite): one warning
    line. Any other difference (an edited lr, base rate, betas, eps) is refused in one line rather than put back
    quietly: files changed after the save leave nothing in the checkpoint to trust, weights included. Then every
    group key and base rate is the config's, the step's rate its schedule's (`optim.resumed_differences`).
    """
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not verified and (why := verify_checkpoint(path, d)):
        raise CheckpointError(f"checkpoint '{path}' cannot be resumed: {why}")
    unstepped = not optimizer.state  # (no state yet: torch's and torchao's get_state_dict below fakes a step for it)
    msd, osd = get_state_dict(model, optimizer, options=state_options(trainable_only))
    state = {"model": msd, "optim": osd}
    # The config's hyperparameters, before the checkpoint's are loaded over them.
    fresh = optimizers.hyperparameters(optimizer, scheduler)
    meta = meta_of(path)
    try:
        saved = integrity.read_dcp_metadata((path / STATE_DIR / ".metadata").read_bytes()).state_dict_metadata
        if why := optimizers.layout_problem(state["optim"], optimizer, saved, meta.get("run"), not trainable_only):
            raise CheckpointError(why)  # (another optim wrote it: said before DCP names its keys)
        with quiet_single_process(), optimizers.saved_group_keys_only(state["optim"], saved):
            integrity.safe_dcp_load(state, path / STATE_DIR)
        trainer = load_trainer_state(path)
        rng = path / RNG_FILE.format(rank=d.rank)
        rng_saved = integrity.load_plain(rng) if rng.is_file() else None
        if not isinstance(trainer, dict) or not {"scheduler", "step", "data_position"} <= trainer.keys():
            raise CheckpointError(f"{STATE_FILE} holds no step, data position and schedule")
        why = optimizers.schedule_problem(trainer["scheduler"], scheduler, trainer["step"])
        if "step" in meta and meta["step"] != trainer["step"]:
            why = f"its {META_FILE} is at step {meta['step']!r} but its {STATE_FILE} at {trainer['step']!r}"
        if why:
            raise CheckpointError(f"{why}: its files disagree; resume from another checkpoint")
        optim_state.drop_fake_step(state["optim"], trainer["step"], unstepped)  # (saved before the first step)
        if why := optim_state.state_problem(state["optim"], state["model"], trainer["step"], d):
            raise CheckpointError(why)  # (NaN, a negative second moment, a wrong shape or step: before training)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint '{path}' cannot be resumed: {e}") from None
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=state_options(trainable_only, load=True),
    )
    scheduler.load_state_dict(trainer["scheduler"])
    recorded = optimizers.recorded_hyperparameters(meta.get("run"))
    unexplained, changed = optimizers.resumed_differences(optimizer, scheduler, fresh, recorded)
    if unexplained:
        raise CheckpointError(
            f"checkpoint '{path}' cannot be resumed: it holds {'; '.join(unexplained)}, which neither this run's "
            f"config nor the run its {META_FILE} records gives: its files were changed after the save (checksums "
            "redone), so its weights cannot be trusted either; resume from a checkpoint you trust, or start the run "
            "again with --overwrite"
        )
    if changed:
        logger.warning("resuming %s with this run's config, changed since it was written: %s", path, "; ".join(changed))
    optimizers.reapply_config(optimizer, scheduler, fresh, trainer["step"])
    if rng_saved is not None:
        set_rng_state(rng_saved)
    else:
        # Resumed on more ranks than wrote it: a rank without its own state gets a fresh stream of its own
        # (only dropout reads it), seeded by rank and step so that the resume is still reproducible.
        seed = d.rank * 1_000_003 + int(trainer["step"])
        random.seed(seed)
        torch.manual_seed(seed)
    return trainer
