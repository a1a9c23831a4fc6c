"""`export` and `merge` write through the guarded layer: NaN/Inf weights, a damaged or mismatched base and a full
disk are one line with exit 2 and nothing written; export takes the run lock; every artifact follows the umask;
SIGTERM leaves no temporary directory, and one that a killed process left is removed by the next run (only ours)."""

from __future__ import annotations

import ast
import fcntl
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError

import hybridtune
from hybridtune.cli import main
from hybridtune.infer import export_command
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import guarded
from hybridtune.run.lock import OutputLock
from hybridtune.run.outdir import RUN_FILE


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished two-step LoRA run of the default preset: final/ (the adapter), base_model/, checkpoint-2/."""
    out = tmp_path_factory.mktemp("export-merge") / "run"
    argv = ["train", "--max_steps", "2", "--save_steps", "2", "--sequence_len", "128", "--eval_steps", "0"]
    assert main([*argv, "--adapter", "lora", "--output_dir", str(out)]) == 0
    return out


def _one_line(capsys) -> str:
    """The one error line the CLI printed (progress bars and log lines may come before it), never a traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _temporaries(*dirs) -> list[str]:
    return sorted(p.name for d in dirs if d.is_dir() for p in d.iterdir() if p.name.startswith(ckpt.TMP_PREFIX))


def _adapter_copy(run_dir, tmp_path, base=None):
    """A copy of the run's adapter, its recorded base `base` (default: a copy of the run's base_model/ beside it,
    which the adapter records relative to itself)."""
    adapter = tmp_path / "adapter"
    shutil.copytree(run_dir / "final", adapter)
    if base is None:
        shutil.copytree(run_dir / "base_model", tmp_path / "base_model")
    else:
        path = adapter / "adapter_config.json"
        config = json.loads(path.read_text())
        config["base_model_name_or_path"] = str(base)
        path.write_text(json.dumps(config))
    return adapter


def _base_copy(run_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(run_dir / "base_model", base)
    return base


def test_merge_refuses_non_finite_weights_before_writing(run_dir, tmp_path, capsys):
    adapter = _adapter_copy(run_dir, tmp_path)
    weights = safetensors.torch.load_file(adapter / "adapter_model.safetensors")
    name = next(k for k in weights if "lora_B" in k)
    weights[name] = torch.full_like(weights[name], float("inf"))
    safetensors.torch.save_file(weights, adapter / "adapter_model.safetensors")
    out = tmp_path / "merged"
    assert main(["merge", str(adapter), str(out)]) == 2
    assert "NaN or Inf" in _one_line(capsys)
    assert not out.exists() and _temporaries(tmp_path) == []


def test_export_refuses_non_finite_weights_before_writing(run_dir, tmp_path, monkeypatch, capsys):
    """A checkpoint tensor holding inf (its checksums rewritten would load it the same way)."""
    real = export_command.open_model

    def poisoned(path):
        opened = real(path)
        param = next(p for n, p in opened.model.named_parameters() if "lora_B" in n)
        with torch.no_grad():
            param.fill_(float("inf"))
        return opened

    monkeypatch.setattr(export_command, "open_model", poisoned)
    out = tmp_path / "export"
    assert main(["export", str(run_dir / "checkpoint-2"), str(out)]) == 2
    assert "NaN or Inf" in _one_line(capsys)
    assert not out.exists()  # nothing written, not even the lock file or the directory


def test_merge_of_a_damaged_base_is_one_line(run_dir, tmp_path, capsys):
    base = _base_copy(run_dir, tmp_path)
    (base / "model.safetensors").write_bytes(b"garbage")
    assert main(["merge", str(_adapter_copy(run_dir, tmp_path, base)), str(tmp_path / "merged")]) == 2
    assert "damaged or incomplete" in _one_line(capsys)


def test_merge_of_a_base_whose_shapes_do_not_match_its_config_is_one_line(run_dir, tmp_path, capsys):
    base = _base_copy(run_dir, tmp_path)
    config = json.loads((base / "config.json").read_text())
    text = config.get("text_config", config)
    text["intermediate_size"] = text["intermediate_size"] * 2
    (base / "config.json").write_text(json.dumps(config))
    assert main(["merge", str(_adapter_copy(run_dir, tmp_path, base)), str(tmp_path / "merged")]) == 2
    assert "cannot load the adapter's base model" in _one_line(capsys)


def test_merge_on_a_full_disk_is_one_line_and_leaves_nothing(run_dir, tmp_path, monkeypatch, capsys):
    adapter = _adapter_copy(run_dir, tmp_path)
    out = tmp_path / "merged"

    def no_space(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull })")

    monkeypatch.setattr(safetensors.torch, "serialize_file", no_space)
    assert main(["merge", str(adapter), str(out)]) == 2
    assert _one_line(capsys).startswith("error: disk full: the merged model needs about")
    assert not out.exists() and _temporaries(tmp_path) == []

    # Too little room is refused before anything is written, with the real size.
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    assert main(["merge", str(adapter), str(out)]) == 2
    err = _one_line(capsys)
    assert "disk full" in err and "1000 bytes free" in err and not out.exists()


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_merged_files_follow_the_umask(run_dir, tmp_path, mask):
    """The bug this guards: merge's safetensors were 0600 (safetensors' temporary file) whatever the umask."""
    out = tmp_path / "merged"
    old = os.umask(mask)
    try:
        assert main(["merge", str(run_dir / "final"), str(out)]) == 0
    finally:
        os.umask(old)
    for p in [out, *out.rglob("*")]:
        want = (0o777 if p.is_dir() else 0o666) & ~mask
        assert stat.S_IMODE(p.stat().st_mode) == want, p


def test_export_overwrite_takes_the_run_lock(run_dir, tmp_path, capsys):
    """A run training in OUT holds its lock: export --overwrite is refused and its record and final/ are kept."""
    busy = tmp_path / "busy"
    shutil.copytree(run_dir, busy)
    record = (busy / RUN_FILE).read_text()
    final = (busy / "final" / "adapter_model.safetensors").read_bytes()
    lock = OutputLock(busy)  # as the running trainer holds it
    try:
        assert main(["export", str(run_dir / "checkpoint-2"), str(busy), "--overwrite"]) == 2
        assert "in use by another hybridtune run" in _one_line(capsys)
    finally:
        lock.release()
    assert (busy / RUN_FILE).read_text() == record
    assert (busy / "final" / "adapter_model.safetensors").read_bytes() == final
    # Once the run has ended, an explicit --overwrite may replace it.
    assert main(["export", str(run_dir / "checkpoint-2"), str(busy), "--overwrite"]) == 0


_KILLED = textwrap.dedent(
    """
    import os, signal, sys
    from hybridtune import cli
    from hybridtune.models import source
    real = source.carry_files
    def carry_then_signal(out_dir, source_dir):
        real(out_dir, source_dir)
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))  # inside the write window, the temporary dir full
    source.carry_files = carry_then_signal
    sys.exit(cli.main(sys.argv[2:]))
    """
)


def _killed(sig: str, *argv, cwd) -> int:
    return subprocess.run(
        [sys.executable, "-c", _KILLED, sig, *argv], cwd=cwd, capture_output=True, timeout=300
    ).returncode


@pytest.mark.slow
def test_sigterm_during_export_and_merge_leaves_no_temporary_directory(run_dir, tmp_path):
    out = tmp_path / "export"
    assert _killed("SIGTERM", "export", str(run_dir / "checkpoint-2"), str(out), cwd=tmp_path) == 130
    assert _temporaries(out, tmp_path) == [] and not (out / "final").exists()
    merged = tmp_path / "merged"
    assert _killed("SIGTERM", "merge", str(run_dir / "final"), str(merged), cwd=tmp_path) == 130
    assert _temporaries(tmp_path) == [] and not merged.exists()


@pytest.mark.slow
def test_a_killed_writes_temporaries_are_removed_next_time_only_ours(run_dir, tmp_path):
    """SIGKILL (no cleanup possible) leaves a model-size temporary; the next export or merge to the same target
    removes it, but not a look-alike without our marker, nor one a live writer holds."""
    out = tmp_path / "export"
    assert _killed("SIGKILL", "export", str(run_dir / "checkpoint-2"), str(out), cwd=tmp_path) == -signal.SIGKILL
    assert [n for n in _temporaries(out) if n.startswith(".tmp-final-")]
    # (base_model/ was committed before final/ was cut: OUT is not empty, so the re-run says --overwrite.)
    assert main(["export", str(run_dir / "checkpoint-2"), str(out), "--overwrite"]) == 0
    assert _temporaries(out) == [] and (out / "final").is_dir()

    merged = tmp_path / "merged"
    assert _killed("SIGKILL", "merge", str(run_dir / "final"), str(merged), cwd=tmp_path) == -signal.SIGKILL
    (stale,) = _temporaries(tmp_path)
    theirs = tmp_path / ".tmp-merged-theirs"  # a user's directory of that name: no marker
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    live = ckpt.make_tmp_dir(merged)  # another merge to the same OUT, still writing
    held = os.open(live / ckpt.MARKER, os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    os.pwrite(held, f"{guarded.WRITER_TAG} 1 on elsewhere\n".encode(), 0)
    try:
        assert main(["merge", str(run_dir / "final"), str(merged)]) == 0
    finally:
        os.close(held)
    left = _temporaries(tmp_path)
    assert stale not in left and theirs.name in left and live.name in left
    assert (theirs / "notes.txt").read_text() == "mine"


def test_no_command_writes_a_model_directory_around_the_guarded_layer():
    """So that a new command cannot forget: only run/guarded.py (and checkpoint.py's own saves) make or commit
    temporary directories, and only the modules that ask `is_ours` first remove directory trees."""
    root = Path(hybridtune.__file__).parent
    allowed = {
        "atomic_dir": {"run/checkpoint.py", "run/guarded.py"},
        "shared_atomic_dir": {"run/checkpoint.py"},
        "make_tmp_dir": {"run/checkpoint.py"},
        "rmtree": {"run/checkpoint.py", "run/guarded.py", "run/outdir.py"},
    }
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in allowed and rel not in allowed[name]:
                    if (
                        name == "atomic_dir"
                        and isinstance(func, ast.Attribute)
                        and getattr(func.value, "id", None) == "guarded"
                    ):
                        continue
                    found.append(f"{rel}:{node.lineno} {name}")
    assert found == [], "write model directories through run/guarded.py: " + ", ".join(found)
