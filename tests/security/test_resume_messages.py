"""Resume messages that said too little (red team 2, defect 20): a DCP offset past the end of its file gave
"state/ cannot be loaded: EOFError: " with an empty reason; `--resume_from_checkpoint latest` after a SIGKILL before
the first checkpoint said only "no checkpoint in 'runs/k9'", where the plain rerun works."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import pytest
from resumes import redo_checksums

from hybridtune.cli import main
from hybridtune.run import checkpoint as ckpt
from hybridtune.run import integrity

TRAIN = ["train", "--sequence_len", "128", "--eval_steps", "0", "--val_set_size", "0", "--save_steps", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, small_data) -> Path:
    """A finished two-step full fine-tune of the default preset with checkpoint-1 and checkpoint-2."""
    out = tmp_path_factory.mktemp("resume-messages") / "run"
    assert main([*TRAIN, "--dataset", small_data, "--max_steps", "2", "--output_dir", str(out)]) == 0
    return out


def past_the_end(checkpoint: Path, extra: int) -> None:
    """Every storage entry of the checkpoint's DCP metadata moved `extra` bytes past the end of its file, and the
    checksums redone (as someone with write access would)."""
    meta_path = checkpoint / ckpt.STATE_DIR / ".metadata"
    md = integrity.read_dcp_metadata(meta_path.read_bytes())
    for key, info in md.storage_data.items():
        size = (checkpoint / ckpt.STATE_DIR / info.relative_path).stat().st_size
        md.storage_data[key] = dataclasses.replace(info, offset=size + extra)
    meta_path.write_bytes(pickle.dumps(md))
    record = ckpt.meta_of(checkpoint)
    redo_checksums(record, checkpoint)
    (checkpoint / ckpt.META_FILE).write_text(__import__("json").dumps(record))


@pytest.mark.parametrize("extra", [0, 1, 4096])
def test_an_offset_past_the_end_of_a_file_says_why(run_dir, tmp_path, error_line, extra):
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    past_the_end(copy / "checkpoint-2", extra)
    line = error_line(["export", str(copy / "checkpoint-2"), str(tmp_path / "out")])
    assert line.startswith(
        f"error: checkpoint '{copy / 'checkpoint-2'}' cannot be loaded: state/ cannot be loaded: "
    ), line
    reason = line.split("state/ cannot be loaded: ", 1)[1]
    assert reason.split(": ", 1)[1].strip(), line  # never an empty reason after the exception's name
    if reason.startswith("EOFError"):
        assert "a read ran past the end of a file of state/" in reason, line


def test_latest_with_no_checkpoint_says_the_plain_rerun_starts_it_again(run_dir, tmp_path, small_data, error_line):
    """A run killed (SIGKILL) after its first step, before its first save: its record, lock and metrics, nothing
    else. The line says what to do, and doing it works."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    for p in [*out.glob("checkpoint-*"), out / "final"]:
        shutil.rmtree(p)
    argv = [*TRAIN, "--dataset", small_data, "--max_steps", "2", "--output_dir", str(out)]
    line = error_line([*argv, "--resume_from_checkpoint", "latest"])
    assert f"no checkpoint in '{out}' (the run stopped before its first save)" in line, line
    assert line.endswith("run the same command without it, which starts the run again"), line
    assert main(argv) == 0 and (out / "final").is_dir()
