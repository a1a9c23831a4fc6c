"""The security tests' resumes: a tiny-preset full fine-tune stopped after its first step (checkpoint-1), resumed
through `hybridtune train`, and a checkpoint edited as someone with write access would, its checksums redone so that
it verifies (checksums have no key: only the resume's own checks can refuse it); `lora_run`, the command line of the
finished two-step LoRA run the security conftest trains (and tests run again over a copy of it)."""

from __future__ import annotations

import shutil

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

from hybridtune.config import load_config
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import integrity
from train_runs import run

KEYS = dict(
    sequence_len=64,
    max_steps=2,
    eval_steps=0,
    logging_steps=1,
    val_set_size=8,
    warmup_steps=2,
    gradient_accumulation_steps=1,
    save_steps=1,
)


def keys(out, data, **kw) -> dict:
    return {**KEYS, **kw, "dataset": data, "output_dir": str(out)}


def interrupted(out, data, **kw) -> dict:
    """`out` holds a run of the tiny preset with `keys(out, data, **kw)`, stopped after step 1 (checkpoint-1); its
    keys."""
    given = keys(out, data, **kw)
    run(load_config(None, given), stop_after=1)
    assert (out / "checkpoint-1" / ckpt.META_FILE).is_file() and not (out / "checkpoint-2").exists()
    return given


def argv(given: dict, *more: str) -> list[str]:
    """`hybridtune train` resuming the run of `given` (its keys) from its latest checkpoint, then `more`."""
    flags = [a for k, v in given.items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]
    return ["train", *flags, "--resume_from_checkpoint", "latest", *more]


def edit_optimizer(path, edit) -> None:
    """`edit(optimizer state)` on checkpoint `path`'s DCP state (by parameter name; "state" and "param_groups"),
    written back as DCP. The checksums are the caller's to redo (`redo_checksums`)."""
    flat = path.parent / "flat.pt"
    dcp_to_torch_save(str(path / ckpt.STATE_DIR), str(flat))
    state = torch.load(flat, weights_only=False)
    edit(state["optim"])
    torch.save(state, flat)
    shutil.rmtree(path / ckpt.STATE_DIR)
    torch_save_to_dcp(str(flat), str(path / ckpt.STATE_DIR))
    flat.unlink()


def redo_checksums(record: dict, path) -> None:
    """`record` (checkpoint `path`'s checkpoint.json) lists every other file of `path` with its checksum as now."""
    record["files"] = integrity.hash_files(path, [f for f in integrity._walk(path)[0] if f != ckpt.META_FILE])


def lora_run(data: str, out) -> list[str]:
    """`hybridtune train` of a two-step LoRA run of the default preset on `data` into `out`, saving at step 2."""
    return ["train", "--sequence_len", "128", "--eval_steps", "0", "--val_set_size", "0", "--max_steps", "2",
            "--dataset", data, "--save_steps", "2", "--adapter", "lora", "--output_dir", str(out)]  # fmt: skip
