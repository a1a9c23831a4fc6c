"""Stopping and resuming: Ctrl-C or SIGTERM mid-step saves after that step and resumes on the same curve; a second
Ctrl-C abandons the step in flight and resumes with its batches; a signal during a save never cuts it; a loss that
stops being finite ends the run before the update with nothing exported; resumed metrics hold each step once."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from hybridtune.errors import TrainingDiverged
from hybridtune.run import checkpoint as ckpt
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg


def _trainer(cfg) -> Trainer:
    t = Trainer(cfg)
    t.setup()
    return t


def _signal_inside_step(t: Trainer, at_step: int, signals: list[int]) -> None:
    """Send `signals` to this process while step `at_step` is in flight: after its batches were drawn from the
    stream (the position has moved past them), before its backward."""
    window = t._window

    def drawn():
        batches = window()
        if t.step + 1 == at_step:
            for s in signals:
                os.kill(os.getpid(), s)
        return batches

    t._window = drawn


def _metric_steps(out) -> list[int]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows if r["type"] == "train"]


@pytest.fixture
def deterministic():
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_data):
    torch.use_deterministic_algorithms(True)
    try:
        return _trainer(make_cfg(tmp_path_factory.mktemp("ref"), small_data)).train().losses
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize(
    "signals, saved_at",
    [
        ([signal.SIGINT], 3),  # the step in flight completes, then the save
        ([signal.SIGTERM], 3),  # kill, docker stop, a scheduler: the same
        ([signal.SIGINT, signal.SIGINT], 2),  # a second Ctrl-C abandons step 3; its batches come first on resume
        ([signal.SIGINT, signal.SIGINT], 3),  # ... but one press seen twice (terminal + torchrun) is one request
    ],
    ids=["sigint", "sigterm", "sigint-twice", "sigint-same-press"],
)
def test_a_signal_inside_a_step_resumes_on_the_uninterrupted_curve(
    tmp_path, small_data, reference, deterministic, signals, saved_at, monkeypatch
):
    from hybridtune.runtime import signals as stop

    if saved_at == 2:
        monkeypatch.setattr(stop, "SAME_PRESS_S", 0.0)  # the second press comes later than a repeat of the first
    t = _trainer(make_cfg(tmp_path, small_data))
    _signal_inside_step(t, 3, signals)
    part = t.train()
    assert part.interrupted and part.steps == saved_at and part.final_dir is None
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [f"checkpoint-{saved_at}"]
    rest = _trainer(make_cfg(tmp_path, small_data, resume_from_checkpoint="latest")).train()
    got = part.losses + rest.losses
    assert len(got) == len(reference) == 8
    assert max(abs(a - b) for a, b in zip(got, reference)) < 1e-6, (got, reference)
    assert _metric_steps(tmp_path) == list(range(1, 9))  # each step logged once, in order


def test_a_second_ctrl_c_during_a_save_does_not_cut_it(tmp_path, small_data, monkeypatch, caplog):
    from hybridtune.runtime import signals as stop

    monkeypatch.setattr(stop, "SAME_PRESS_S", 0.0)  # a real second press, not a repeat of the first
    t = _trainer(make_cfg(tmp_path, small_data, max_steps=4))
    save = ckpt.save_checkpoint

    def save_with_ctrl_c(*args, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # pressed again while the checkpoint is written
        return save(*args, **kw)

    monkeypatch.setattr(ckpt, "save_checkpoint", save_with_ctrl_c)
    _signal_inside_step(t, 2, [signal.SIGINT])
    res = t.train()
    assert res.interrupted and res.steps == 2
    path = tmp_path / "checkpoint-2"
    assert ckpt.list_checkpoints(tmp_path) == [path]
    assert ckpt.verify_checkpoint(path) is None  # complete and intact
    assert any("it finishes first" in r.getMessage() for r in caplog.records)  # the press was seen, and deferred


def test_a_non_finite_loss_stops_before_the_update_and_exports_nothing(tmp_path, small_data):
    t = _trainer(make_cfg(tmp_path, small_data, learning_rate=1e6, max_steps=6, warmup_steps=0))
    with pytest.raises(TrainingDiverged, match=r"step \d: the loss is .*lower learning_rate \(1e\+06\)") as e:
        t.train()
    assert "the last checkpoint is kept" not in str(e.value)  # this run saved none: nothing may claim one
    assert not list(tmp_path.glob("checkpoint-*"))
    assert all(torch.isfinite(p).all() for p in t.model.parameters())  # the bad update was never applied
    assert not (tmp_path / "final").exists()
    assert TrainingDiverged.exit_code == 3


def test_resume_at_the_last_step_finishes_without_training_again(tmp_path, small_data):
    t = _trainer(make_cfg(tmp_path, small_data, max_steps=3))

    def stop_at_3(rec):
        if rec["step"] == 3:
            raise KeyboardInterrupt  # between steps: step 3 is complete, saved, nothing exported yet

    t.on_log = stop_at_3
    assert t.train().interrupted
    again = _trainer(make_cfg(tmp_path, small_data, max_steps=3, resume_from_checkpoint="latest")).train()
    assert again.losses == [] and again.steps == 3 and again.final_dir is not None
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-3"]


def test_eval_max_examples_zero_is_refused_not_logged_as_a_zero_loss(tmp_path, small_data):
    from hybridtune.errors import ConfigError

    with pytest.raises(ConfigError, match="'eval_max_examples' = 0 must be at least 1"):
        make_cfg(tmp_path, small_data, eval_max_examples=0)


def test_divergence_on_the_last_update_exports_nothing(tmp_path, small_data):
    """The last update is checked by no later step's loss: the weights (and the final eval) are, before the save."""
    t = _trainer(make_cfg(tmp_path, small_data, learning_rate=1e6, max_steps=1, warmup_steps=0, eval_steps=0))
    with pytest.raises(TrainingDiverged, match=r"step 1: the (eval loss is nan|trained weights are not finite)"):
        t.train()
    assert not (tmp_path / "final").exists()


def test_ctrl_c_in_the_final_eval_keeps_the_last_checkpoint_and_the_resume_finishes(tmp_path, small_data, monkeypatch):
    from hybridtune.runtime import signals as stop

    monkeypatch.setattr(stop, "SAME_PRESS_S", 0.0)
    t = _trainer(make_cfg(tmp_path, small_data, max_steps=2))
    evaluate = t.run_eval

    def pressed_twice(result=None):
        if t.step == 2:  # the final eval
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return evaluate(result)

    t.run_eval = pressed_twice
    res = t.train()
    assert res.interrupted and res.final_dir is None
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["checkpoint-2"]
    done = _trainer(make_cfg(tmp_path, small_data, max_steps=2, resume_from_checkpoint="latest")).train()
    assert done.losses == [] and done.final_dir is not None


def test_sigterm_during_setup_leaves_nothing_behind(tmp_path, small_data, monkeypatch):
    from hybridtune.train import trainer as trainer_module

    out = tmp_path / "run"
    t = trainer_module.Trainer(make_cfg(out, small_data, max_steps=2))

    def killed():
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(t, "_setup_model", killed)
    with pytest.raises(KeyboardInterrupt):
        t.setup()
    assert not out.exists()
