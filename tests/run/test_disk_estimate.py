"""The start-of-run estimate of what a run writes (run/space.py): a line of figures that match what the run then
writes; a run fitted to a disk too small for its checkpoints (fewer kept, or the periodic saves skipped) that still
ends with final/; a refusal in one line, before anything is written, when not even the final model fits."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from hybridtune.cli import main
from hybridtune.run import disk
from hybridtune.run.space import Room, need, plan

GIB = 2**30
ROOT = Path("/data")


def room(checkpoint: float, final: float, free: float, **kw) -> Room:
    return Room(int(checkpoint * GIB), int(final * GIB), int(free * GIB), ROOT, **kw)


# -- the plan ----------------------------------------------------------------------------------------------------


def test_a_run_that_fits_is_one_line_of_figures():
    limit, every, line, warning = plan(room(10, 4, 100), 2, 5, 0, 20)  # saves at 5, 10, 15 and 20: 2 kept
    assert (limit, every, warning) == (2, 5, None)
    assert line == (
        "disk: a checkpoint ~10.00 GiB x 2 kept (+1 while the next is written) + final ~4.00 GiB; "
        "100.00 GiB free at '/data'"
    )


def test_the_measured_7b_case_keeps_final_and_says_no_checkpoint_fits():
    """A 7B full fine-tune on an H200 box: checkpoints of 80.6 GiB, final/ 14 GiB, 28.2 GiB free."""
    limit, every, line, warning = plan(room(80.6, 14, 28.2), 2, 10, 0, 25)
    assert line.startswith(
        "disk: a checkpoint ~80.60 GiB x 2 kept (+1 while the next is written) + final ~14.00 GiB; 28.20 GiB free"
    )
    assert (limit, every) == (2, 0)
    assert warning.startswith("the checkpoints do not all fit (241.80 GiB at most, 28.20 GiB free): ")
    assert "the periodic saves (steps 10, 20) are skipped (save_steps 10 -> 0)" in warning
    assert "no checkpoint fits" in warning and "final/ (the trained model) written instead" in warning


def test_fewer_checkpoints_are_kept_when_that_is_enough():
    limit, every, _, warning = plan(room(10, 4, 25), 3, 1, 0, 5)  # room for 1 kept + 1 written, beside final/
    assert (limit, every) == (1, 1)
    assert "save_total_limit 3 -> 1" in warning and "save_steps" not in warning
    assert "final/ (the trained model) is written at the end" in warning


def test_periodic_saves_are_skipped_when_only_the_last_fits():
    limit, every, _, warning = plan(room(10, 4, 15), 2, 100, 0, 1000)
    assert (limit, every) == (2, 0)
    assert "save_steps 100 -> 0: the periodic saves (steps 100, 200, ..., 900) are skipped" in warning
    assert "with the last step's checkpoint" in warning and "save_total_limit" not in warning  # one save: kept


def test_a_last_checkpoint_that_leaves_no_room_for_final_is_said():
    _, every, _, warning = plan(room(10, 8, 12), 2, 0, 0, 5)
    assert every == 0
    assert "the last step's checkpoint fits but final/ will not fit beside it" in warning
    assert "unless 6.00 GiB more is freed" in warning


def test_not_even_the_final_model_is_refused_in_one_line():
    with pytest.raises(disk.DiskFullError) as e:
        plan(room(10, 4, 3), 2, 0, 0, 5)
    msg = str(e.value)
    assert msg.startswith("disk full: this run's final model alone needs about 4.00 GiB (each checkpoint ~10.00 GiB")
    assert "'/data' has 3.00 GiB free; nothing was written" in msg and "\n" not in msg


def test_a_resume_counts_its_own_checkpoints_and_a_fresh_run_the_room_it_frees():
    # Resumed at 10 with checkpoint-5 and -10 kept: the save at 15 prunes -5, the one at 20 prunes -10.
    r = room(10, 4, 10, existing=2)
    assert need(r, 2, 2) == 10 * GIB and plan(r, 2, 5, 10, 20)[3] is None
    assert need(r, 2, 3) == 20 * GIB  # a higher limit keeps them all: two more
    # A fresh run over an earlier run's 30 GiB of checkpoints: they are removed before training.
    limit, every, line, warning = plan(room(10, 4, 5, freed=30 * GIB), 2, 0, 0, 5)
    assert warning is None and line.endswith(
        "5.00 GiB free at '/data' (+30.00 GiB as the earlier run's checkpoints are cleared first)"
    )


# -- the run -----------------------------------------------------------------------------------------------------

ARGV = ["train", "--sequence_len", "128", "--eval_steps", "0"]


def sizes(line: str) -> tuple[float, float]:
    unit = {"bytes": 1, "MiB": 2**20, "GiB": 2**30}
    m = re.search(r"a checkpoint ~([\d.]+) (\w+) x \d+ kept.* \+ final ~([\d.]+) (\w+);", line)
    assert m, line
    return float(m[1]) * unit[m[2]], float(m[3]) * unit[m[4]]


def du(*paths: Path) -> int:
    return sum(os.path.getsize(Path(r) / f) for p in paths for r, _, fs in os.walk(p) for f in fs)


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_the_figures_match_what_the_run_writes(tmp_path, capfd, adapter):
    out = tmp_path / "run"
    assert main([*ARGV, "--max_steps", "2", "--adapter", adapter, "--output_dir", str(out)]) == 0
    err = capfd.readouterr().err
    (line,) = [x for x in err.splitlines() if " disk: " in x]
    checkpoint, final = sizes(line)
    assert "x 1 kept + final ~" in line and f" free at '{out}'" in line
    written = du(out / "checkpoint-2"), du(out / "final", out / "base_model")
    assert written[0] <= checkpoint <= 1.25 * written[0], (line, written)
    assert written[1] <= final <= 1.25 * written[1], (line, written)


def test_a_disk_too_small_for_checkpoints_still_ends_with_final(tmp_path, monkeypatch, capfd):
    """tiny-qwen3_5, full fine-tune: a checkpoint ~10.7 MiB, final/ ~3.7 MiB; 7 MB free."""
    out = tmp_path / "run"
    real = shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=7_000_000))
    assert main([*ARGV, "--max_steps", "3", "--save_steps", "1", "--output_dir", str(out)]) == 0
    err = capfd.readouterr().err
    warning = [x for x in err.splitlines() if "the checkpoints do not all fit" in x]
    assert len(warning) == 1 and "the periodic saves (steps 1, 2) are skipped (save_steps 1 -> 0)" in warning[0]
    assert "no checkpoint fits" in warning[0]
    assert (out / "final" / "config.json").is_file() and not list(out.glob("checkpoint-*"))
    assert "writing final/ (the trained model) anyway" in err


def test_a_disk_too_small_for_the_final_model_is_refused_before_anything_is_written(tmp_path, monkeypatch, capfd):
    out = tmp_path / "run"
    real = shutil.disk_usage
    monkeypatch.setattr(disk.shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000))
    assert main([*ARGV, "--max_steps", "3", "--output_dir", str(out)]) == 2
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: disk full: this run's final model alone needs about 3.")
    assert f"'{out}' has 1000000 bytes free; nothing was written" in lines[0], lines[0]
    assert not re.search(r"\bstep +1\b", err)
    assert not out.exists() or not [p for p in out.iterdir()], sorted(os.listdir(out))
