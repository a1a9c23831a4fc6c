"""The output directory's rules: a resume never writes over another run's or a user's files, a finished run is
replaced only by the same command or under --overwrite, data files count by content, a resume says what changed
in the config and refuses it, and one run at a time holds a directory."""

from __future__ import annotations

import json

import pytest
from test_resume import make_cfg

from hybridtune.errors import OutputDirError
from hybridtune.train import outdir
from hybridtune.train.trainer import Trainer


def _train(cfg):
    t = Trainer(cfg)
    t.setup()
    return t.train()


@pytest.fixture(scope="module")
def finished(tmp_path_factory, small_data):
    """A finished 2-step run (checkpoint-2, final/) to resume from or run over."""
    out = tmp_path_factory.mktemp("finished")
    _train(make_cfg(out, small_data, max_steps=2, eval_steps=0))
    return out


def _user_files(d):
    (d / "final").mkdir(parents=True)
    (d / "final" / "paper.pdf").write_text("mine")
    (d / "checkpoint-4").mkdir()
    (d / "checkpoint-4" / "thesis.tex").write_text("mine")
    (d / ".tmp-cache").mkdir()
    (d / ".tmp-cache" / "blob").write_text("mine")


def test_resume_from_another_runs_checkpoint_never_touches_a_users_files(tmp_path, small_data, finished):
    target = tmp_path / "mine"
    _user_files(target)
    cfg = make_cfg(target, small_data, max_steps=4, resume_from_checkpoint=str(finished / "checkpoint-2"))
    with pytest.raises(OutputDirError, match="not from a hybridtune run"):
        Trainer(cfg).setup()
    for f in ("final/paper.pdf", "checkpoint-4/thesis.tex", ".tmp-cache/blob"):
        assert (target / f).read_text() == "mine", f


def test_a_finished_run_is_replaced_only_by_the_same_command(tmp_path, small_data, finished):
    with pytest.raises(OutputDirError, match=r"finished run of another config \(max_steps: 2 -> 3\)"):
        outdir.check_output_dir(make_cfg(finished, small_data, max_steps=3, eval_steps=0))
    assert outdir.check_output_dir(make_cfg(finished, small_data, max_steps=2, eval_steps=0, logging_steps=5))
    assert outdir.check_output_dir(make_cfg(finished, small_data, max_steps=3, eval_steps=0, overwrite=True))


def test_data_files_count_by_content(tmp_path, small_data):
    data = tmp_path / "data.jsonl"
    data.write_text(open(small_data).read())
    out = tmp_path / "run"
    _train(make_cfg(out, str(data), max_steps=1, eval_steps=0))
    assert outdir.check_output_dir(make_cfg(out, str(data), max_steps=1, eval_steps=0))  # unchanged: the same run
    rows = data.read_text().splitlines()
    data.write_text("\n".join(rows[::-1]) + "\n")  # the same path, other content
    with pytest.raises(OutputDirError, match=f"data file {data} changed since that run"):
        outdir.check_output_dir(make_cfg(out, str(data), max_steps=1, eval_steps=0))


def test_resume_says_what_changed_and_refuses(tmp_path, small_data, finished):
    resume = dict(resume_from_checkpoint="latest", eval_steps=0)
    for change, said in [
        (dict(max_steps=5), "max_steps: 2 -> 5"),  # would stretch the schedule: the LR would jump back up
        (dict(max_steps=2, sequence_len=96), "sequence_len: 64 -> 96"),  # the saved data position means other bins
        (dict(max_steps=2, adapter="lora"), "adapter: 'full' -> 'lora'"),  # was a DCP traceback
    ]:
        with pytest.raises(OutputDirError, match=f"config differs from the run .*{said}"):
            outdir.check_output_dir(make_cfg(finished, small_data, **resume, **change))
    # What a resume may change: how often it logs, saves, evaluates.
    assert outdir.check_output_dir(make_cfg(finished, small_data, max_steps=2, save_steps=1, **resume)) is False
    # Accepted explicitly: --overwrite continues under the new config (and says what changed).
    assert outdir.check_output_dir(make_cfg(finished, small_data, max_steps=5, overwrite=True, **resume)) is False


def test_one_run_at_a_time_holds_a_directory(tmp_path, small_data):
    out = tmp_path / "run"
    first = Trainer(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    first.setup()  # holds the lock until it trains or closes
    second = Trainer(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    with pytest.raises(OutputDirError, match=r"in use by another hybridtune run \(pid \d+ on "):
        second.setup()
    first.train()  # releases it
    lock_file = out / outdir.LOCK_FILE
    assert lock_file.is_file() and not lock_file.is_symlink()
    again = Trainer(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    again.setup()
    again.close()


def test_the_lock_file_is_never_followed_through_a_planted_link(tmp_path, small_data):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / outdir.LOCK_FILE).symlink_to(victim)
    with pytest.raises(OutputDirError, match="cannot create its lock file"):
        outdir.claim_output_dir(make_cfg(out, small_data, max_steps=1))
    assert victim.read_text() == "keep"


def test_the_run_file_holds_the_data_checksums(tmp_path, small_data):
    out = tmp_path / "run"
    _train(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    held = json.loads((out / outdir.RUN_FILE).read_text())
    assert list(held["data"]) == [small_data] and len(held["data"][small_data]) == 64


def test_overwrite_never_replaces_a_final_dir_hybridtune_did_not_write(tmp_path, small_data):
    out = tmp_path / "run"
    (out / "final").mkdir(parents=True)
    (out / "final" / "paper.pdf").write_text("mine")
    with pytest.raises(OutputDirError, match="holds final/ not written by hybridtune; --overwrite never replaces it"):
        outdir.check_output_dir(make_cfg(out, small_data, max_steps=1, overwrite=True))
    assert (out / "final" / "paper.pdf").read_text() == "mine"
