"""The output directory's rules: a resume never writes over another run's or a user's files, a finished run is
replaced only by the same command or under --overwrite, data files count by content, a resume says what changed
in the config and refuses it, and one run at a time holds a directory."""

from __future__ import annotations

import json

import pytest

from hybridtune.errors import OutputDirError
from hybridtune.run import outdir
from hybridtune.run.lock import LOCK_FILE
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg, record_run


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
    with pytest.raises(OutputDirError, match="final/ not written by hybridtune"):
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


def test_a_test_datasets_file_counts_by_content_too(tmp_path, small_data):
    test = tmp_path / "test.jsonl"
    test.write_text(open(small_data).read())
    cfg = make_cfg(tmp_path / "run", small_data, max_steps=1, test_datasets=[{"path": str(test)}])
    held = outdir.run_record(cfg)
    assert outdir.changes(held, cfg, (), outdir.data_fingerprint(cfg)) == []
    test.write_text(test.read_text() + test.read_text())
    assert outdir.changes(held, cfg, (), outdir.data_fingerprint(cfg)) == [f"data file {test} changed since that run"]


def test_a_dataset_directory_a_glob_and_a_chat_template_file_count_by_content(tmp_path, small_data):
    """A directory or a glob of data files, or the chat_template file, edited in place between a run and its resume is
    another run's data (they were not hashed: a resume over changed data went on silently)."""
    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    (repo / "train.jsonl").write_text(open(small_data).read())
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}")
    for path in (str(tmp_path / "repo"), str(repo / "*.jsonl")):
        cfg = make_cfg(tmp_path / "run", path, max_steps=1, chat_template=str(template))
        held = outdir.run_record(cfg)
        assert outdir.changes(held, cfg, (), outdir.data_fingerprint(cfg)) == []
        (repo / "more.jsonl").write_text(open(small_data).read())  # a file added
        assert outdir.changes(held, cfg, (), outdir.data_fingerprint(cfg)) == [
            f"data file {path} changed since that run"
        ]
        (repo / "more.jsonl").unlink()
        (repo / "train.jsonl").write_text(open(small_data).read() * 2)  # a file edited
        assert outdir.changes(held, cfg, (), outdir.data_fingerprint(cfg)) == [
            f"data file {path} changed since that run"
        ]
        (repo / "train.jsonl").write_text(open(small_data).read())
    template.write_text(template.read_text() + "{{ eos_token }}")
    assert outdir.changes(held, cfg, (), outdir.data_fingerprint(cfg)) == [
        f"data file {template} changed since that run"
    ]


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


def test_a_key_newer_than_the_run_counts_at_its_default(tmp_path, small_data):
    """A run recorded before a config key existed ran as that key's default does: resuming it (or the same command
    again) with the key at its default is no change; another value is named against the default. A key the
    config no longer has is not compared (nothing can set it)."""
    cfg = make_cfg(tmp_path, small_data, max_steps=2)
    held = outdir.run_record(cfg)
    held["config"].pop("seed")  # as if `seed` were added after the run
    held["config"]["a_key_since_removed"] = 3
    data = outdir.data_fingerprint(cfg)
    assert outdir.changes(held, cfg, (), data) == []
    assert outdir.changes(held, make_cfg(tmp_path, small_data, max_steps=2, seed=7), (), data) == ["seed: 42 -> 7"]


def test_one_run_at_a_time_holds_a_directory(tmp_path, small_data):
    out = tmp_path / "run"
    first = Trainer(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    first.setup()  # holds the lock until it trains or closes
    second = Trainer(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    with pytest.raises(OutputDirError, match=r"in use by another hybridtune run \(pid \d+ on "):
        second.setup()
    first.train()  # releases it
    lock_file = out / LOCK_FILE
    assert lock_file.is_file() and not lock_file.is_symlink()
    again = Trainer(make_cfg(out, small_data, max_steps=1, eval_steps=0))
    again.setup()
    again.close()


def test_the_lock_file_is_never_followed_through_a_planted_link(tmp_path, small_data):
    out = tmp_path / "run"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (out / LOCK_FILE).symlink_to(victim)
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
    with pytest.raises(OutputDirError, match=r"holds final/ not written by hybridtune.*--overwrite never does"):
        outdir.check_output_dir(make_cfg(out, small_data, max_steps=1, overwrite=True))
    assert (out / "final" / "paper.pdf").read_text() == "mine"


# Red-team findings (each failed before its fix).


def test_a_planted_metrics_link_is_never_written_through(tmp_path, small_data):
    out = tmp_path / "run"
    _train(make_cfg(out, small_data, max_steps=2, eval_steps=0, save_steps=1))
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")

    def plant():
        (out / "metrics.jsonl").unlink()
        (out / "metrics.jsonl").symlink_to(victim)

    plant()
    with pytest.raises(OutputDirError, match="metrics.jsonl' is not a plain file"):  # a resume appends: refused
        _train(make_cfg(out, small_data, max_steps=2, eval_steps=0, save_steps=1, resume_from_checkpoint="latest"))
    _train(make_cfg(out, small_data, max_steps=2, eval_steps=0, save_steps=1))  # a fresh log replaces the link
    assert victim.read_text() == "keep" and not (out / "metrics.jsonl").is_symlink()


@pytest.mark.parametrize("how", ["resume", "rerun"])
def test_a_users_final_dir_is_never_replaced(tmp_path, small_data, finished, how):
    out = tmp_path / "run"
    _train(make_cfg(out, small_data, max_steps=2, eval_steps=0, save_steps=1))
    import shutil

    shutil.rmtree(out / "final")
    (out / "final").mkdir()
    (out / "final" / "paper.pdf").write_text("mine")
    extra = dict(resume_from_checkpoint=str(finished / "checkpoint-2")) if how == "resume" else {}
    if how == "rerun":
        for p in out.glob("checkpoint-*"):
            shutil.rmtree(p)
    with pytest.raises(OutputDirError, match="holds final/ not written by hybridtune"):
        outdir.check_output_dir(make_cfg(out, small_data, max_steps=2, eval_steps=0, save_steps=1, **extra))
    assert (out / "final" / "paper.pdf").read_text() == "mine"


def test_a_run_that_fails_its_checks_removes_nothing(tmp_path, small_data):
    out = tmp_path / "run"
    _train(make_cfg(out, small_data, max_steps=4, eval_steps=0, save_steps=2))
    before = sorted(p.name for p in out.glob("checkpoint-*"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": 5}\n')
    from hybridtune.errors import DataError

    with pytest.raises(DataError):
        _train(make_cfg(out, str(bad), max_steps=4, eval_steps=0, overwrite=True))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == before == ["checkpoint-2", "checkpoint-4"]


def test_pruning_removes_only_hybridtunes_checkpoints(tmp_path, small_data):
    out = tmp_path / "run"
    _train(make_cfg(out, small_data, max_steps=2, eval_steps=0, save_steps=2))
    theirs = out / "checkpoint-1"
    theirs.mkdir()
    (theirs / "checkpoint.json").write_text('{"note": 1}')
    (theirs / "results.csv").write_text("mine")
    more = dict(max_steps=4, save_steps=1, save_total_limit=1, overwrite=True)  # (a longer run: accepted explicitly)
    _train(make_cfg(out, small_data, eval_steps=0, resume_from_checkpoint=str(out / "checkpoint-2"), **more))
    assert (theirs / "results.csv").read_text() == "mine"
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-4"]


def test_resume_into_an_empty_dir_compares_with_the_checkpoints_own_record(tmp_path, small_data, finished):
    ckpt_dir = str(finished / "checkpoint-2")
    with pytest.raises(OutputDirError, match="sequence_len: 64 -> 32"):
        outdir.check_output_dir(make_cfg(tmp_path / "new", small_data, max_steps=2, eval_steps=0, sequence_len=32,
                                         resume_from_checkpoint=ckpt_dir))  # fmt: skip
    assert (
        outdir.check_output_dir(
            make_cfg(tmp_path / "new", small_data, max_steps=2, eval_steps=0, resume_from_checkpoint=ckpt_dir)
        )
        is False
    )


def test_the_same_run_under_another_spelling_is_the_same_run(tmp_path, small_data, finished, monkeypatch):
    """A trailing slash, an absolute path to the same data, save_total_limit, dataset_num_proc: nothing the run
    computes changes."""
    monkeypatch.chdir(tmp_path)
    import os
    import shutil

    local = tmp_path / "data.jsonl"
    shutil.copy(small_data, local)
    out = tmp_path / "run"
    _train(make_cfg(out, "data.jsonl", max_steps=1, eval_steps=0))
    again = make_cfg(str(out) + os.sep, str(local), max_steps=1, eval_steps=0, save_total_limit=5, dataset_num_proc=2)
    assert outdir.check_output_dir(again)


def test_a_lock_file_that_is_not_a_plain_file_is_one_line(tmp_path, small_data):
    import os

    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / LOCK_FILE)
    with pytest.raises(OutputDirError, match="is not a plain file"):
        outdir.claim_output_dir(make_cfg(out, small_data, max_steps=1))


def test_resume_may_switch_cuda_graphs_but_not_the_sequence_len(tmp_path, small_data, finished):
    """CUDA graphs replay the same compiled kernels, so a resume may turn them on or off (as it may change the
    processes); a key that changes what is computed is still named and refused."""
    ckpt_dir = str(finished / "checkpoint-2")
    keys = dict(max_steps=2, eval_steps=0, resume_from_checkpoint=ckpt_dir)
    outdir.check_output_dir(make_cfg(tmp_path / "a", small_data, cuda_graphs="off", **keys))
    with pytest.raises(OutputDirError, match="sequence_len: 64 -> 32"):
        outdir.check_output_dir(make_cfg(tmp_path / "b", small_data, cuda_graphs="off", sequence_len=32, **keys))


def test_what_an_accepted_change_is_said_once(tmp_path, small_data, finished, caplog):
    """The output directory is checked twice (before and under the lock); what it accepts is said once."""
    import logging
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    caplog.set_level(logging.INFO)
    outdir.claim_output_dir(make_cfg(out, small_data, max_steps=3, eval_steps=0, resume_from_checkpoint="latest",
                                     overwrite=True))[1].release()  # fmt: skip
    assert caplog.text.count("resuming under a changed config (--overwrite): max_steps: 2 -> 3") == 1
    caplog.clear()
    outdir.claim_output_dir(make_cfg(out, small_data, max_steps=3, eval_steps=0, overwrite=True))[1].release()
    assert caplog.text.count("holds another run; --overwrite given") == 1


# --- compile_regions and the run file: regions compute what the inlined loop computes -----------------------------


@pytest.mark.parametrize("before,after", [(False, True), (True, False)])
def test_resume_may_switch_compile_regions(tmp_path, small_data, before, after):
    """compile_regions traces each distinct layer once instead of inlining it: the same model, loss and gradients
    (as cuda_graphs replays the same kernels), so a resume may switch it, e.g. to get a deep model's first step."""
    out = tmp_path / "run"
    record_run(out, make_cfg(out, small_data, compile="loop", compile_regions=before))
    cfg = make_cfg(out, small_data, compile="loop", compile_regions=after, resume_from_checkpoint="latest")
    outdir.check_output_dir(cfg)


def test_same_command_again_over_a_run_recorded_with_regions_off(tmp_path, small_data):
    """A run file that recorded `compile_regions: false` (the default before auto) and the same command again under
    the default auto: not another config (compile_regions and cuda_graphs are outdir.RERUN_FREE_KEYS)."""
    out = tmp_path / "run"
    record_run(out, make_cfg(out, small_data, compile="loop", compile_regions=False))
    cfg = make_cfg(out, small_data, compile="loop")
    assert outdir.check_output_dir(cfg) is True


def test_same_command_again_after_switching_regions_explicitly(tmp_path, small_data):
    """A finished run with regions on, run again with `--compile_regions false` (to compare the first step, say):
    nothing it computes changes, so it is the same command, not a refusal asking for --overwrite."""
    out = tmp_path / "run"
    record_run(out, make_cfg(out, small_data, compile="loop", compile_regions=True))
    assert outdir.check_output_dir(make_cfg(out, small_data, compile="loop", compile_regions=False)) is True


@pytest.mark.parametrize("before", [False, True])
def test_resume_of_a_run_recorded_with_explicit_regions(tmp_path, small_data, before):
    """A resume over a run file with false/true, under the default auto, is accepted."""
    out = tmp_path / "run"
    record_run(out, make_cfg(out, small_data, compile="loop", compile_regions=before))
    outdir.check_output_dir(make_cfg(out, small_data, compile="loop", resume_from_checkpoint="latest"))


def test_a_run_file_without_the_key_counts_at_the_default(tmp_path, small_data):
    """A run file without compile_regions (older than the key) compares at today's default: no change reported."""
    out = tmp_path / "run"
    cfg = make_cfg(out, small_data, compile="loop")
    record_run(out, cfg)
    record = json.loads((out / outdir.RUN_FILE).read_text())
    del record["config"]["compile_regions"]
    (out / outdir.RUN_FILE).write_text(json.dumps(record))
    assert outdir.check_output_dir(cfg) is True
