"""`hybridtune export` on a full disk says so in one line: the disk is full, where, how much the export needed against
what is free, and what it changed (nothing, unless a part was complete before the disk filled), never the trainer's
"no checkpoint was saved"."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
from safetensors import SafetensorError

from hybridtune.cli import main
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import disk
from hybridtune.run.lock import LOCK_FILE

ENOSPC = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """checkpoint-2 of a two-step LoRA run of the default preset (its export writes base_model/, then final/)."""
    out = tmp_path_factory.mktemp("full-disk-export") / "run"
    argv = ["train", "--max_steps", "2", "--save_steps", "2", "--sequence_len", "128", "--eval_steps", "0"]
    assert main([*argv, "--adapter", "lora", "--output_dir", str(out)]) == 0
    return ckpt.list_checkpoints(out)[-1]


def error_of(argv: list[str], capsys) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.replace("\r", "\n").splitlines() if x.startswith("error: ")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "no checkpoint was saved" not in lines[0] and "run again" not in lines[0], lines[0]
    return lines[0]


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under `root` but the lock (which each export takes) by its inode and mtime."""
    files = [p for p in sorted(root.rglob("*")) if p.is_file() and p.name != LOCK_FILE]
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns) for p in files}


def test_an_export_that_cannot_fit_is_refused_with_the_figures(checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    real = shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    msg = error_of(["export", str(checkpoint), str(out)], capsys)
    assert msg.startswith(f"error: disk full: exporting '{checkpoint}' needs about "), msg
    assert f"'{tmp_path}' has 1000 bytes free; nothing was changed." in msg, msg
    assert msg.endswith("and run the export again"), msg
    assert not out.exists()  # not even the directory or its lock


def test_a_refused_overwrite_leaves_the_earlier_export_as_it_was(checkpoint, tmp_path, monkeypatch, capsys):
    out = tmp_path / "export"
    assert main(["export", str(checkpoint), str(out)]) == 0
    before = tree(out)
    real = shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    msg = error_of(["export", str(checkpoint), str(out), "--overwrite"], capsys)
    assert f"'{out}' has 1000 bytes free; nothing was changed." in msg, msg
    assert tree(out) == before


@pytest.mark.parametrize("nth", [1, 2])
def test_a_disk_that_fills_midway_says_what_was_written(checkpoint, tmp_path, monkeypatch, capsys, nth):
    """The nth safetensors file runs out of space: 1 = base_model/ (nothing kept), 2 = final/ (base_model/ done)."""
    out = tmp_path / "export"
    real = safetensors.torch.serialize_file
    calls = []

    def serialize_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == nth:
            Path(filename).write_bytes(b"partial")
            raise SafetensorError(ENOSPC)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)
    msg = error_of(["export", str(checkpoint), str(out)], capsys)
    assert msg.startswith(f"error: disk full: exporting '{checkpoint}' ran out of space while writing (about "), msg
    assert " was estimated; '" in msg and " free now)" in msg, msg
    if nth == 1:
        assert "; nothing was changed." in msg and not out.exists(), msg
    else:
        assert f"; only base_model/ in '{out}' changed (written before the disk filled), nothing else." in msg, msg
        assert sorted(os.listdir(out)) == ["base_model"]
    assert not [p for p in tmp_path.rglob(".tmp-*")]  # the partial directory is removed
