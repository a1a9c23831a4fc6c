"""The final export: every file it writes follows the umask (safetensors writes through a 0600 temporary file), and
a full disk is one line (`DiskFullError`) that leaves the last checkpoint intact and nothing half-written behind.

A tiny LoRA run (on a preset: `final/` holds the adapter, `base_model/` the base weights) and a tiny full run are
trained once each; the tests export them again with `Trainer.save_final` under the conditions they test.
"""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import pytest
import safetensors.torch
from safetensors import SafetensorError

from hybridtune.run import checkpoint as ckpt
from hybridtune.run import disk
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg

ENOSPC = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def _trained(tmp_path_factory, small_data, adapter: str) -> Trainer:
    out = tmp_path_factory.mktemp(f"export-{adapter}")
    t = Trainer(make_cfg(out, small_data, adapter=adapter, max_steps=2, gradient_accumulation_steps=1))
    t.setup()
    t.train()
    return t


@pytest.fixture(scope="module")
def lora(tmp_path_factory, small_data) -> Trainer:
    return _trained(tmp_path_factory, small_data, "lora")


@pytest.fixture(scope="module")
def full(tmp_path_factory, small_data) -> Trainer:
    return _trained(tmp_path_factory, small_data, "full")


def exported(out: Path) -> list[Path]:
    return [p for d in ("final", "base_model") if (out / d).exists() for p in [out / d, *(out / d).rglob("*")]]


def snapshot(out: Path) -> dict[str, tuple[int, int]]:
    """Every entry of the output directory with its size and mtime: what a refused export must leave as it was."""
    return {str(p.relative_to(out)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(out.rglob("*"))}


# -- modes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_exported_files_follow_the_umask(request, adapter):
    t = request.getfixturevalue(adapter)
    weights = ["final/adapter_model.safetensors", "base_model/model.safetensors"]
    if adapter == "full":
        weights = ["final/model.safetensors"]
    for mask in (0o022, 0o077):
        old = os.umask(mask)
        try:
            t.save_final()
        finally:
            os.umask(old)
        paths = exported(t.out)
        for w in weights:
            assert t.out / w in paths
        wrong = {
            str(p.relative_to(t.out)): oct(stat.S_IMODE(p.stat().st_mode))
            for p in paths
            if stat.S_IMODE(p.stat().st_mode) != (0o777 if p.is_dir() else 0o666) & ~mask
        }
        assert not wrong, f"umask {mask:03o}: {wrong}"


# -- disk full -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_export_that_cannot_fit_is_refused_before_writing(request, monkeypatch, adapter):
    t = request.getfixturevalue(adapter)
    last = ckpt.list_checkpoints(t.out)[-1]
    before = snapshot(t.out)
    real = shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(ckpt.DiskFullError) as e:
        t.save_final()
    msg = str(e.value)
    what = "base_model/ and final/" if adapter == "lora" else "final/"
    assert msg.startswith(f"disk full: exporting {what} needs about ") and f"'{t.out}' has 1000 bytes free" in msg
    assert f"the last checkpoint {last.name} is intact" in msg and "--resume_from_checkpoint latest" in msg
    assert "only evaluates and exports" in msg and "\n" not in msg
    number, unit = msg.split("needs about ")[1].split()[:2]
    need = float(number) * {"bytes": 1, "MiB": 2**20, "GiB": 2**30}[unit]
    weights = sum(p.stat().st_size for p in (t.out / "final").glob("*.safetensors"))
    assert need >= weights  # the estimate covers at least the weights the export writes
    assert snapshot(t.out) == before  # nothing written, the earlier export untouched
    assert ckpt.verify_checkpoint(last) is None


@pytest.mark.parametrize("adapter,nth", [("lora", 1), ("lora", 2), ("full", 1)])
def test_disk_full_midway_removes_the_partial_export_and_says_so(request, monkeypatch, adapter, nth):
    """The nth safetensors file written runs out of space (lora: 1 = base_model/, 2 = final/'s adapter)."""
    t = request.getfixturevalue(adapter)
    last = ckpt.list_checkpoints(t.out)[-1]
    real = safetensors.torch.serialize_file
    calls = []

    def serialize_file(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == nth:
            Path(filename).write_bytes(b"partial")
            raise SafetensorError(ENOSPC)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize_file)
    with pytest.raises(ckpt.DiskFullError) as e:
        t.save_final()
    msg = str(e.value)
    assert msg.startswith("disk full: exporting ") and "no space left; " in msg and "\n" not in msg
    assert f"the last checkpoint {last.name} is intact" in msg and "--resume_from_checkpoint latest" in msg
    assert not list(t.out.glob(".tmp-*"))  # the partial temporary directory is removed
    assert ckpt.verify_checkpoint(last) is None

    # Another write failure is not called a full disk.
    calls.clear()
    monkeypatch.setattr(
        safetensors.torch,
        "serialize_file",
        lambda *a, **kw: (_ for _ in ()).throw(SafetensorError("Error while serializing: permission denied")),
    )
    with pytest.raises(SafetensorError):
        t.save_final()
    assert not list(t.out.glob(".tmp-*"))

    # With room again, the export completes.
    monkeypatch.setattr(safetensors.torch, "serialize_file", real)
    t.save_final()
    assert (t.out / "final" / ckpt.FINAL_META).is_file()
