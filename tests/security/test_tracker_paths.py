"""`report_to` never writes or removes anything outside `output_dir/runs/`: `run_name` is a plain name, links under
runs/ are refused, and a fresh run removes only the event files of a directory hybridtune made."""

from __future__ import annotations

import re

import pytest

from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.errors import ConfigError, OutputDirError
from hybridtune.run import checkpoint as ckpt
from hybridtune.train.trackers import open_tracker

pytest.importorskip("tensorboard")

OTHER = "events.out.tfevents.1.other.1.0"


@pytest.fixture
def other_tool(tmp_path):
    """Another tool's TensorBoard directory, outside any run."""
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / OTHER).write_text("x")
    return tb


def _open(out, run_name=None, fresh=True):
    cfg = load_config(None, dict(output_dir=str(out), report_to="tensorboard", run_name=run_name), warn=False)
    tracker = open_tracker(cfg, out, fresh, 0)
    tracker.close()


@pytest.mark.parametrize("name", ["ABS", "../../tb", "sub/../../../tb", "..", "."])
def test_a_run_name_that_is_not_a_plain_name_is_refused(tmp_path, other_tool, name):
    """The bug this guards: `--run_name /abs/dir` (or `../..`) made a fresh run delete another tool's event files
    there and write its own."""
    name = str(other_tool) if name == "ABS" else name
    out = tmp_path / "a" / "b" / "run"
    out.mkdir(parents=True)
    with pytest.raises(ConfigError, match="not a plain name"):
        _open(out, name)
    assert [p.name for p in other_tool.iterdir()] == [OTHER]


@pytest.mark.parametrize("linked", ["runs", "runs/run"])
def test_links_under_runs_are_refused(tmp_path, linked):
    """The bug this guards: a planted `runs/<name>` (or `runs`) link made a fresh run delete the event files of the
    directory it points at."""
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "run").mkdir(parents=True)
    (elsewhere / "run" / OTHER).write_text("x")
    out = tmp_path / "out"
    out.mkdir()
    if linked == "runs":
        (out / "runs").symlink_to(elsewhere)
    else:
        (out / "runs").mkdir()
        (out / "runs" / "run").symlink_to(elsewhere / "run")
    with pytest.raises(OutputDirError, match="symbolic link"):
        _open(out, "run")
    assert [p.name for p in (elsewhere / "run").iterdir()] == [OTHER]


def test_a_fresh_run_keeps_event_files_hybridtune_did_not_write(tmp_path):
    out = tmp_path / "run"
    logdir = out / "runs" / "run"
    logdir.mkdir(parents=True)
    (logdir / OTHER).write_text("x")  # put there by the user or another tool: no marker in the directory
    _open(out, "run")
    assert (logdir / OTHER).read_text() == "x"
    # A directory hybridtune made (the marker) is its own: a fresh run there replaces its event files.
    fresh = out / "runs" / "mine"
    _open(out, "mine")
    assert (fresh / ckpt.MARKER).is_file() and len(list(fresh.glob("events.out.tfevents.*"))) == 1
    _open(out, "mine")
    assert len(list(fresh.glob("events.out.tfevents.*"))) == 1


def test_train_with_an_absolute_run_name_is_one_line_and_touches_nothing_outside(tmp_path, other_tool, capsys):
    argv = ["train", "--max_steps", "1", "--sequence_len", "128", "--eval_steps", "0", "--output_dir"]
    rc = main([*argv, str(tmp_path / "run"), "--report_to", "tensorboard", "--run_name", str(other_tool)])
    err = capsys.readouterr().err
    assert rc == 2 and len(re.findall(r"^error: ", err, re.M)) == 1 and "Traceback" not in err
    assert "run_name" in err and [p.name for p in other_tool.iterdir()] == [OTHER]
