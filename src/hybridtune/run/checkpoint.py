"""Atomic, verified checkpoints: written to a temporary directory beside the target, fsynced, then renamed.

```
checkpoint-120/
  state/.metadata  state/__0_0.distcp  state/__1_0.distcp   model + optimizer (DCP), sharded as trained
  trainer_state.pt                                          scheduler, step, data position, world size
  rng-0.pt  rng-1.pt                                        per-rank RNG (dropout)
  .hybridtune                                               marker: a directory hybridtune wrote
  checkpoint.json                                           step, data position, base model, checksums
```

DCP reshards on load, so a checkpoint written by N processes resumes in M. The rename, by rank 0 after every rank has
written, is the commit point. `checkpoint.json`, written last, lists every other file's size and sha256; a resume
verifies them all before reading and loads nothing that could run code (`integrity`). `resume_from_checkpoint
latest` falls back to the newest intact checkpoint, saying what it skipped and why (run/resume.py).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from hybridtune.errors import OutputDirError
from hybridtune.files import honour_umask, read_regular_text
from hybridtune.run import disk, integrity, write_errors
from hybridtune.run.disk import DiskFullError
from hybridtune.run.integrity import CheckpointError
from hybridtune.run.rng import rng_state
from hybridtune.runtime import distributed
from hybridtune.runtime.distributed import ONE, Dist
from hybridtune.runtime.memory import optimizer_state

__all__ = ["CheckpointError", "DiskFullError", "rng_state"]  # re-exported: callers use them from here

STATE_DIR = "state"
STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"
RNG_FILE = "rng-{rank}.pt"
MARKER = ".hybridtune"  # in every directory atomic_dir makes: only such directories are ever removed
FINAL_DIR = "final"  # the final export; FINAL_META inside it records the step it was taken at
FINAL_META = "hybridtune.json"
TMP_PREFIX = ".tmp-"  # atomic_dir's directory before its commit
OLD_PREFIX = ".old-"  # the replaced directory during a commit
REQUIRED = (f"{STATE_DIR}/.metadata", STATE_FILE)
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer and chat template: a checkpoint opened elsewhere reads its own


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


def make_tmp_dir(target: Path) -> Path:
    """A new, uniquely named `.tmp-<name>-*` directory beside `target`, carrying the marker from its first
    moment (so that only hybridtune's own temporary directories are ever tidied away), with the mode a plain
    mkdir would give it under this umask (tempfile makes it 0700)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{target.name}-", dir=target.parent))
    try:
        fd = os.open(tmp / MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        os.close(fd)
        honour_umask(tmp, directory=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def atomic_dir(target: Path, write: Callable[[Path], None]) -> Path:
    """Create directory `target` atomically: `write(tmp)` fills a temp dir that is then renamed over.

    An existing `target` is replaced only after the new one is complete (moved aside, then removed).
    """
    target = Path(target)
    tmp = make_tmp_dir(target)
    try:
        write(tmp)
        _commit(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


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
        tmp = str(make_tmp_dir(target))
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


@contextmanager
def quiet_single_process():
    """DCP warns on every call that it assumes one process when no process group exists: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def state_options(trainable_only: bool, load: bool = False):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # LoRA: only the adapter and its optimizer state are saved; the frozen base is rebuilt from base_model,
    # so loading must not ask for it (DCP itself fails on a key the checkpoint lacks).
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not (trainable_only and load))


def state_estimate(
    model: torch.nn.Module,
    params: list,
    d: Dist = ONE,
    trainable_only: bool = False,
    optim: str = "adamw",
    masters: bool = False,
) -> int:
    """The bytes of the state `save_checkpoint` writes for `model` and the optimizer `optim` over `params`, before
    the optimizer has allocated its state (torch's and torchao's do at the first step): what it holds per
    parameter once it has stepped (`memory.optimizer_state`: moments typed as the parameter, or fp32 with the fp32
    masters of MasterAdamW under `masters`, or torchao's 8-bit codes and scales). A collective under torchrun
    (`disk.state_bytes`)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    msd = get_model_state_dict(model, options=state_options(trainable_only))
    held = [optimizer_state(optim, p, masters) for p in params]
    return disk.state_bytes(msd, held, d=d)


def _before_save(target: Path, need: int, previous: Path | None) -> None:
    if target.exists() and not is_ours(target):
        raise OutputDirError(
            f"'{target}' exists and was not written by hybridtune (no {MARKER} marker or checkpoint.json): a save "
            "would replace it; move it away or choose another --output_dir"
        )
    disk.check_free_space(target.parent, need, lambda free: disk.disk_full_message(target, need, free, previous))


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
    tokenizer=None,
) -> Path:
    """Write checkpoint `target` (e.g. output_dir/checkpoint-120) atomically; a collective on every rank.

    `model` is what the optimizer steps (plain, DDP- or FSDP2-wrapped): DCP saves each rank's shard. A save
    that cannot fit on the disk is refused before anything is written, and one that runs out of space
    midway is removed; both raise DiskFullError (the previous checkpoint is intact).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    target = Path(target)
    rng = rng_state()  # (first: get_state_dict's fake step of an unstepped adamw_bf16_sr draws its rounding from it)
    msd, osd = get_state_dict(model, optimizer, options=state_options(trainable_only))
    need = disk.state_bytes(msd, osd, d=d)
    done = [p for p in list_checkpoints(target.parent) if p != target]
    previous = done[-1] if done else None
    distributed.main_only(d, lambda: _before_save(target, need, previous))
    files: dict[str, dict] = {}

    def guarded(write: Callable[[Path], None]) -> Callable[[Path], None]:
        return write_errors.guard(
            write, need, lambda free: disk.disk_full_message(target, need, free, previous),
            lambda why: disk.write_failed_message(target, why, previous),
        )  # fmt: skip

    def write_all(tmp: Path) -> None:
        with quiet_single_process():
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp / STATE_DIR))
        torch.save(rng, tmp / RNG_FILE.format(rank=d.rank))
        distributed.barrier(d)  # every rank's files are complete: hash them, each rank its share
        files.update(integrity.manifest(tmp, {META_FILE, STATE_FILE}, d))

    def write_main(tmp: Path) -> None:
        state = {"scheduler": scheduler.state_dict(), "step": step, "data_position": data_position, "world": d.world}
        torch.save(state, tmp / STATE_FILE)
        files.update(integrity.hash_files(tmp, [STATE_FILE]))
        if tokenizer is not None:  # the template trained with travels with the weights (what export writes)
            tokenizer.save_pretrained(str(tmp / TOKENIZER_DIR))
            own = sorted(str(p.relative_to(tmp)) for p in (tmp / TOKENIZER_DIR).rglob("*") if p.is_file())
            files.update(integrity.hash_files(tmp, own))
        meta = {"format": integrity.FORMAT, "step": step, "data_position": data_position, "world_size": d.world}
        meta.update(extra or {})
        meta["files"] = dict(sorted(files.items()))
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2))  # last: the checksums of complete files

    try:
        return shared_atomic_dir(target, guarded(write_all), guarded(write_main), d)
    except OSError as e:  # around the writes: the temporary directory made (a disk turned read-only), the renames
        if disk.is_disk_full(e, target.parent, need):
            raise DiskFullError(disk.disk_full_message(target, need, None, previous), need) from None
        if (why := write_errors.failure(e)) is None:
            raise
        raise write_errors.WriteError(disk.write_failed_message(target, why, previous), why) from None


def verify_checkpoint(path: Path, d: Dist = ONE) -> str | None:
    """Why checkpoint `path` must not be resumed (the first file that failed, and how), or None when it is
    intact: every file listed with its checksum in checkpoint.json, nothing missing, changed or added.
    A collective (each rank hashes its share)."""
    return integrity.check(Path(path), META_FILE, REQUIRED, d)


def load_weights(path: Path, model: torch.nn.Module, trainable_only: bool) -> dict:
    """The model weights of checkpoint `path` alone (no optimizer, RNG or scheduler), into `model` as the trainer
    built it before wrapping (patched or not, peft-wrapped for LoRA): the checkpoint names its tensors after the
    trainer's `LossModule`, which wraps it here too. Verified first, loaded with nothing that runs code; returns
    the trainer state (`step`, ...). For a checkpoint used outside training (generate, eval, export)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = Path(path)
    why = verify_checkpoint(path)
    if why:
        raise CheckpointError(f"checkpoint '{path}' cannot be loaded: {why}")
    wrapped = distributed.LossModule(model)
    state = {"model": get_model_state_dict(wrapped, options=state_options(trainable_only))}
    try:
        with quiet_single_process():
            integrity.safe_dcp_load(state, path / STATE_DIR)
        trainer = load_trainer_state(path)
    except CheckpointError as e:
        raise CheckpointError(f"checkpoint '{path}' cannot be loaded: {e}") from None
    set_model_state_dict(wrapped, state["model"], options=state_options(trainable_only, load=True))
    return trainer


def is_step_dir(p: Path) -> bool:
    return p.name.split("-", 1)[1].isdigit() and p.is_dir() and not p.is_symlink()


def is_step_link(p: Path) -> bool:
    return p.name.split("-", 1)[1].isdigit() and p.is_symlink()


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first (temp dirs never match)."""
    out = [p for p in Path(output_dir).glob("checkpoint-*") if is_step_dir(p) and (p / META_FILE).is_file()]
    return sorted(out, key=step_of)


def _json(path: Path):
    try:
        return json.loads(read_regular_text(path))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        return None


def meta_of(path: Path) -> dict:
    """A checkpoint's checkpoint.json as a mapping (empty when unreadable: call after verify_checkpoint)."""
    meta = _json(Path(path) / META_FILE)
    return meta if isinstance(meta, dict) else {}


def is_ours(path: Path) -> bool:
    """Whether hybridtune wrote directory `path`, so that it may remove or replace it: the marker every
    directory `atomic_dir` makes carries, or (written before the marker existed) a checkpoint.json holding a
    checkpoint's step and data position, or a final export's hybridtune.json. Never a symbolic link."""
    p = Path(path)
    if p.is_symlink() or not p.is_dir():
        return False
    if (p / MARKER).is_file():
        return True
    meta, final = _json(p / META_FILE), _json(p / FINAL_META)
    return (isinstance(meta, dict) and {"step", "data_position"} <= meta.keys()) or (
        isinstance(final, dict) and "steps" in final
    )


def prune_checkpoints(output_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints, counting and removing only hybridtune's own (`is_ours`)."""
    for p in [p for p in list_checkpoints(output_dir) if is_ours(p)][:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def step_of(path: Path) -> int:
    return int(path.name.split("-", 1)[1])


def load_trainer_state(ckpt: Path) -> dict:
    """The scheduler, step, data position and world size of checkpoint `ckpt` (tensors and plain values only)."""
    return integrity.load_plain(Path(ckpt) / STATE_FILE)


def own_tokenizer(path: Path) -> Path | None:
    """The tokenizer directory checkpoint `path` holds (verified against its checksums), or None for a checkpoint
    written before checkpoints carried one. Never a path that checkpoint.json names: only its own files."""
    path = Path(path)
    files = (meta_of(path) or {}).get("files")
    own = [rel for rel in files if rel.startswith(TOKENIZER_DIR + "/")] if isinstance(files, dict) else []
    if not own:
        return None
    for rel in own:
        if ".." in Path(rel).parts:
            raise CheckpointError(f"checkpoint '{path}' cannot be loaded: {META_FILE} lists '{rel}', outside it")
        why = integrity.file_problem(path, rel, files[rel])
        if why:
            raise CheckpointError(f"checkpoint '{path}' cannot be loaded: {why}")
    present = {str(p.relative_to(path)) for p in (path / TOKENIZER_DIR).rglob("*") if not p.is_dir()}
    if present - set(own):
        extra = sorted(present - set(own))[0]
        raise CheckpointError(f"checkpoint '{path}' cannot be loaded: {extra} is not listed in {META_FILE}")
    return path / TOKENIZER_DIR
