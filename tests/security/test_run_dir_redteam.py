"""The output-directory red team of issue 47 (trust II, part B), each case as found: a FIFO where a run's record or a
checkpoint.json belongs hung `export --overwrite`, `train` and a resume for ever (the read blocked); `merge
--overwrite` replaced a checkpoint or a run's final/ with a merged model, and `export` or `train` wrote into a
checkpoint (its checksums then fail and a resume skips it); an OUT under a file said "check the disk"."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest
from resumes import lora_run

from hybridtune.cli import main
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.outdir import RUN_FILE

TRAIN = ["train", "--sequence_len", "128", "--eval_steps", "0", "--val_set_size", "0", "--max_steps", "2"]


@contextlib.contextmanager
def within(seconds: int):
    """Fail rather than hang: a read that blocks (a FIFO) is cut by SIGALRM."""

    def expired(signum, frame):
        raise AssertionError(f"still running after {seconds} s (a blocked read)")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_fifo_as_the_record_of_out_does_not_hang_export(lora_run_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / RUN_FILE)
    with within(120):
        assert main(["export", str(lora_run_dir / "checkpoint-2"), str(out), "--overwrite"]) == 0
    assert (out / "final" / "adapter_model.safetensors").is_file()


def test_a_fifo_as_the_record_of_output_dir_does_not_hang_train(tmp_path, small_data, error_line):
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / RUN_FILE)
    with within(120):
        line = error_line([*TRAIN, "--dataset", small_data, "--output_dir", str(out)])
    assert f"holds files that are not from a hybridtune run ({RUN_FILE})" in line, line


def test_a_fifo_as_checkpoint_json_does_not_hang_a_resume(lora_run_copy, small_data, error_line):
    meta = lora_run_copy / "checkpoint-2" / ckpt.META_FILE
    meta.unlink()
    os.mkfifo(meta)
    argv = lora_run(small_data, lora_run_copy)
    with within(120):
        line = error_line([*argv, "--resume_from_checkpoint", "latest"])
    assert "checkpoint-2: cannot be read:" in line and "is not a regular file" in line, line


@pytest.mark.parametrize("part", ["checkpoint-2", "final", "base_model"])
def test_merge_overwrite_never_replaces_a_part_of_a_run(lora_run_copy, tmp_path, error_line, part):
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_run_copy / "final", adapter)
    shutil.copytree(lora_run_copy / "base_model", tmp_path / "base_model")
    before = snapshot(lora_run_copy)
    line = error_line(["merge", str(adapter), str(lora_run_copy / part), "--overwrite"])
    kind = "a training checkpoint" if part.startswith("checkpoint") else f"a run's {part}/"
    assert f"OUT_DIR '{lora_run_copy / part}' is {kind}, which a write there would damage" in line, line
    assert snapshot(lora_run_copy) == before


@pytest.mark.parametrize("command", ["export", "train"])
def test_nothing_is_written_inside_a_checkpoint(lora_run_copy, lora_run_dir, small_data, error_line, command):
    inside = lora_run_copy / "checkpoint-2" / "x"
    before = snapshot(lora_run_copy)
    argv = {
        "export": ["export", str(lora_run_dir / "checkpoint-2"), str(inside)],
        "train": [*TRAIN, "--dataset", small_data, "--output_dir", str(inside)],
    }[command]
    line = error_line(argv)
    assert f"lies inside '{lora_run_copy / 'checkpoint-2'}', a training checkpoint" in line, line
    assert snapshot(lora_run_copy) == before and ckpt.verify_checkpoint(lora_run_copy / "checkpoint-2") is None


def test_an_out_under_a_file_says_so(lora_run_dir, tmp_path, error_line):
    (tmp_path / "afile").write_text("mine")
    line = error_line(["export", str(lora_run_dir / "checkpoint-2"), str(tmp_path / "afile" / "sub")])
    assert "Not a directory (ENOTDIR); a part of the path is a file" in line, line
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_run_record_the_system_refuses_is_one_line(tmp_path, small_data, monkeypatch, error_line):
    """`(ulimit -f 2; hybridtune train ...)`: the record's write failed with EFBIG in a traceback."""
    from hybridtune.run import outdir

    real = outdir.atomic_write_text

    def refused(path, text):
        if Path(path).name == RUN_FILE:
            raise OSError(27, "File too large")
        return real(path, text)

    monkeypatch.setattr(outdir, "atomic_write_text", refused)
    out = tmp_path / "run"
    line = error_line([*TRAIN, "--dataset", small_data, "--output_dir", str(out)])
    assert line.startswith(f"error: cannot write the run's record {out / RUN_FILE}: File too large (EFBIG)"), line


def test_a_link_named_otherwise_to_a_final_is_still_a_final(lora_run_copy, tmp_path, error_line):
    """`merge ADAPTER link/sub` with `link -> run/final`: the path's own names said nothing of final/."""
    link = tmp_path / "elsewhere"
    link.symlink_to(lora_run_copy / "final")
    before = snapshot(lora_run_copy)
    line = error_line(["merge", str(lora_run_copy / "final"), str(link / "sub")])
    assert f"lies inside '{lora_run_copy / 'final'}', a run's final/" in line, line
    assert snapshot(lora_run_copy) == before


def test_an_earlier_merged_export_is_not_left_beside_another_step(lora_run_copy, tmp_path, error_line):
    """`export CKPT OUT --merged`, then `export OTHER OUT --overwrite`: OUT/merged/ stayed the first checkpoint's."""
    out = tmp_path / "out"
    assert main(["export", str(lora_run_copy / "checkpoint-2"), str(out), "--merged"]) == 0
    before = snapshot(out)
    line = error_line(["export", str(lora_run_copy / "checkpoint-2"), str(out), "--overwrite"])
    assert "holds merged/ of an earlier export" in line and "pass --merged to replace it too" in line, line
    assert snapshot(out) == before
    assert main(["export", str(lora_run_copy / "checkpoint-2"), str(out), "--overwrite", "--merged"]) == 0
