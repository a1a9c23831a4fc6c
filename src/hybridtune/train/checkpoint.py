"""Atomic checkpoints: written to a temporary directory beside the target, fsynced, then renamed.

A checkpoint holds the trainable weights (the LoRA adapter, or the full model), the optimizer and
scheduler states, every RNG state, the data position and the step. A crash or Ctrl-C mid-write
leaves the previous checkpoint intact: the rename is the commit point.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

STATE_FILE = "trainer_state.pt"
META_FILE = "checkpoint.json"


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
        _fsync_tree(tmp)
        if target.exists():
            old = target.parent / f".old-{target.name}-{os.getpid()}"
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    target: Path, model, optimizer, scheduler, step: int, data_position: dict, extra: dict | None = None
) -> Path:
    """Write checkpoint `target` (e.g. output_dir/checkpoint-120) atomically."""

    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        torch.save(
            {
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "rng": rng_state(),
                "step": step,
                "data_position": data_position,
            },
            tmp / STATE_FILE,
        )
        (tmp / META_FILE).write_text(
            json.dumps({"step": step, "data_position": data_position, **(extra or {})}, indent=2)
        )

    return atomic_dir(target, write)


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
