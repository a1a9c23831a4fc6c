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

from hybridtune.errors import ConfigError
from hybridtune.train import distributed
from hybridtune.train.distributed import ONE, Dist

STATE_DIR = "state"
STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"
RNG_FILE = "rng-{rank}.pt"


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
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent))
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
        old = target.parent / f".old-{target.name}-{os.getpid()}"
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
        tmp = tempfile.mkdtemp(prefix=f".tmp-{target.name}-", dir=target.parent)
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


def load_trainer_state(ckpt: Path) -> dict:
    return torch.load(Path(ckpt) / STATE_FILE, map_location="cpu", weights_only=False)
