"""Atomic checkpoints: written to a temporary directory beside the target, fsynced, then renamed.

A checkpoint holds the trainable weights (the LoRA adapter, or the full model) and the optimizer state
through `torch.distributed.checkpoint` (DCP, in `state/`: one file per rank plus `.metadata`), the
scheduler state, the data position and the step (`trainer_state.pt`), each rank's RNG state
(`rng-<rank>.pt`) and `checkpoint.json`. DCP reshards on load, so a checkpoint written by N processes
(DDP, FSDP2 or one process) resumes in M. A crash, Ctrl-C or a dead rank mid-write leaves the previous
checkpoint intact: the rename, done by rank 0 after every rank has written, is the commit point.

```
checkpoint-120/
  state/.metadata  state/__0_0.distcp  state/__1_0.distcp   model + optimizer, sharded as trained
  trainer_state.pt                                          scheduler, step, data position, world size
  rng-0.pt  rng-1.pt                                        per-rank RNG (dropout)
  checkpoint.json                                           step, data position, base model (human-readable)
```
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridtune.errors import ConfigError, OutputDirError
from hybridtune.train import distributed
from hybridtune.train.distributed import ONE, Dist

STATE_DIR = "state"
STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"
RNG_FILE = "rng-{rank}.pt"
FINAL_DIR = "final"  # the final export; FINAL_META inside it records the step it was taken at
FINAL_META = "hybridtune.json"
TMP_PREFIX = ".tmp-"  # atomic_dir's directory before its commit
OLD_PREFIX = ".old-"  # the replaced directory during a commit


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Create directory `target` atomically: `write(tmp)` fills a temp dir that is then renamed over.

    An existing `target` is replaced only after the new one is complete (moved aside, then removed).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        write(tmp)
        _commit(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small file so that a reader sees the old content or the new, never a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _commit(tmp: Path, target: Path) -> None:
    _fsync_tree(tmp)
    if target.exists():
        old = target.parent / f"{OLD_PREFIX}{target.name}-{os.getpid()}"
        os.replace(target, old)
        os.replace(tmp, target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, target)


def shared_atomic_dir(target: Path, write_all: Callable[[Path], None], write_main: Callable[[Path], None], d: Dist):
    """`atomic_dir` written by every rank: `write_all(tmp)` on each (collectives allowed), then `write_main(tmp)`
    on rank 0, which renames once every rank is done. One process: plain `atomic_dir`.

    Ranks share the filesystem (one machine). A rank that dies mid-write leaves only a `.tmp-*` directory,
    which `list_checkpoints` never returns.
    """
    target = Path(target)
    if not d.enabled:
        return atomic_dir(target, lambda tmp: (write_all(tmp), write_main(tmp)))
    tmp = None
    if d.is_main:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent)
    tmp = Path(distributed.broadcast_object(tmp, d))
    try:
        write_all(tmp)
        distributed.barrier(d)
        if d.is_main:
            write_main(tmp)
            _commit(tmp, target)
        distributed.barrier(d)  # nobody reads or prunes before the rename
    except BaseException:
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def rng_state() -> dict:
    """This process's RNG states: Python, torch CPU, and the CUDA generator of the device it trains on
    (one per rank, so a checkpoint restores on any number of visible GPUs)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda_device"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda_device" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda_device"], torch.cuda.current_device())


@contextmanager
def _quiet_single_process():
    """DCP warns on every call that it assumes one process when no process group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _options(trainable_only: bool, load: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: only the adapter and its optimizer state are saved; the frozen base is rebuilt from base_model,
    # so loading must not ask for it (DCP itself fails on a key the checkpoint lacks).
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not (trainable_only and load))


def save_checkpoint(
    target: Path,
    model: torch.nn.Module,
    optimizer,
    scheduler,
    step: int,
    data_position: dict,
    extra: dict | None = None,
    d: Dist = ONE,
    trainable_only: bool = False,
) -> Path:
    """Write checkpoint `target` (e.g. output_dir/checkpoint-120) atomically; a collective on every rank.

    `model` is what the optimizer steps (plain, DDP- or FSDP2-wrapped): DCP saves each rank's shard.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def write_all(tmp: Path) -> None:
        msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
        with _quiet_single_process():
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / STATE_DIR))
        torch.save(rng_state(), tmp / RNG_FILE.format(rank=d.rank))

    def write_main(tmp: Path) -> None:
        state = {"scheduler": scheduler.state_dict(), "step": step, "data_position": data_position, "world": d.world}
        torch.save(state, tmp / STATE_FILE)
        meta = {"step": step, "data_position": data_position, "world_size": d.world, **(extra or {})}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))

    return shared_atomic_dir(target, write_all, write_main, d)


def load_checkpoint(
    path: Path, model: torch.nn.Module, optimizer, scheduler, d: Dist = ONE, trainable_only: bool = False
) -> dict:
    """Load weights, optimizer, scheduler and this rank's RNG from checkpoint `path` (written by any number of
    processes); returns the trainer state (`step`, `data_position`, `world`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    if not (path / STATE_DIR / ".metadata").is_file():
        raise ConfigError(
            f"checkpoint '{path}' has no {STATE_DIR}/ (torch.distributed.checkpoint) directory: it was written by an "
            "older hybridtune and cannot be resumed by this one; start a new run"
        )
    msd, osd = get_state_dict(model, optimizer, options=_options(trainable_only))
    state = {"model": msd, "optim": osd}
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(path / STATE_DIR))
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_options(trainable_only, load=True),
    )
    trainer = load_trainer_state(path)
    scheduler.load_state_dict(trainer["scheduler"])
    rng = path / RNG_FILE.format(rank=d.rank)
    if rng.is_file():
        set_rng_state(torch.load(rng, map_location="cpu", weights_only=False))
    else:
        # Resumed on more ranks than wrote it: a rank without its own state gets a fresh stream of its own
        # (only dropout reads it), seeded by rank and step so that the resume is still reproducible.
        seed = d.rank * 1_000_003 + int(trainer["step"])
        random.seed(seed)
        torch.manual_seed(seed)
    return trainer


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (temp dirs never match)."""
    out = []
    for p in Path(output_dir).glob("checkpoint-*"):
        if p.is_dir() and (p / META_FILE).is_file() and p.name.split("-", 1)[1].isdigit():
            out.append(p)
    return sorted(out, key=lambda p: int(p.name.split("-", 1)[1]))


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    for p in list_checkpoints(output_dir)[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def _step(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def _finished(output_dir: Path, newest: Path) -> bool:
    """The run that wrote `newest` also wrote its final model: `final/` says it ran to that same step."""
    try:
        return json.loads((Path(output_dir) / FINAL_DIR / FINAL_META).read_text())["steps"] == _step(newest)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def check_restart(output_dir: Path) -> None:
    """A fresh run of the same config may start over a finished run, not over an unfinished one's checkpoints.

    Starting again removes them (see `tidy_output_dir`); without --overwrite that is almost always a
    forgotten `--resume_from_checkpoint latest` after a crash or Ctrl-C, so it is refused.
    """
    found = list_checkpoints(output_dir)
    if found and not _finished(output_dir, found[-1]):
        raise OutputDirError(
            f"output_dir '{output_dir}' holds an unfinished run of this config (newest {found[-1].name}, no final "
            "model after it); continue it with --resume_from_checkpoint latest, or pass --overwrite to start over "
            "(its checkpoints are removed)"
        )


def tidy_output_dir(output_dir: Path, fresh: bool, resume_from: str | None, overwrite: bool) -> str | None:
    """Before training, on rank 0: remove what earlier processes left in `output_dir` that would mislead this run.

    - Always: temporary directories of writes that never committed (`.tmp-*`: a process or rank died
      mid-save), and `.old-X-*` copies whose replacement `X` was committed. (An `.old-X` without `X`, a crash
      between the two renames of a commit, is the last committed copy of `X`: left alone.)
    - A fresh run (`fresh`: the caller has allowed it, i.e. an empty directory, a restart of a finished run
      of the same config, or --overwrite): every `checkpoint-N/` of the earlier run. Left there, their higher
      step numbers would make pruning delete this run's new checkpoints first and `latest` resume the old run.
    - A run resumed from step S: checkpoints of `output_dir` past S are another continuation that this run
      would replace; removed under --overwrite, refused otherwise (nothing is touched then).

    Returns the one line that says what was removed, or None when nothing was.
    """
    out = Path(output_dir)
    if not out.is_dir():
        return None
    stale = [p for p in sorted(out.iterdir()) if p.is_dir() and _is_stale(p)]
    start = None
    if fresh:
        checkpoints = [p for p in out.glob("checkpoint-*") if p.is_dir() and p.name.split("-", 1)[1].isdigit()]
    else:
        start = _resume_step(resume_from)
        checkpoints = [p for p in list_checkpoints(out) if start is not None and _step(p) > start]
        if checkpoints and not overwrite:
            raise OutputDirError(
                f"resume_from_checkpoint '{resume_from}' is at step {start} but output_dir '{out}' holds later "
                f"checkpoints ({', '.join(p.name for p in checkpoints)}) that this run would replace and that "
                "'latest' would pick; pass --overwrite to remove them, or resume into another --output_dir"
            )
    checkpoints.sort(key=_step)
    for p in stale + checkpoints:
        shutil.rmtree(p)
    done = []
    if checkpoints:
        why = "of the earlier run" if fresh else f"past the resumed step {start}"
        done.append(f"{len(checkpoints)} checkpoint(s) {why} ({', '.join(p.name for p in checkpoints)})")
    if stale:
        done.append(f"{len(stale)} stale temporary dir(s) ({', '.join(p.name for p in stale)})")
    return f"output_dir {out}: removed " + " and ".join(done) if done else None


def _is_stale(path: Path) -> bool:
    if path.name.startswith(TMP_PREFIX):
        return True
    committed = path.parent / path.name[len(OLD_PREFIX) :].rsplit("-", 1)[0]  # .old-<name>-<pid>
    return path.name.startswith(OLD_PREFIX) and committed.exists()


def _resume_step(resume_from: str | None) -> int | None:
    """The step a run resumes from, when that is a complete checkpoint (`latest`: none is past it)."""
    if not resume_from or resume_from == "latest":
        return None
    try:
        return int(json.loads((Path(resume_from) / META_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None  # not a complete checkpoint: the resume itself says so, after the model is built


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE_FILE, map_location="cpu", weights_only=False)
