"""A resume trains with the run's config, not with what a checkpoint's files say. A checkpoint's optimizer groups and
schedule (lr, initial_lr, betas, eps, weight_decay, the schedule's base and last rates and step) edited by hand with
its checksums redone resumed silently with them (red team: a tampered lr trained on); so did a learning rate written
into checkpoint.json's run record, which no checksum covers, under `learning_rate: auto` (a resume takes the rate
its run recorded). Now a value that neither the config nor the checkpoint's own run record gives is one
CheckpointError line (exit 2) naming the checkpoint, the key, the saved and the expected value; one that its record
gives (the config changed since, under --overwrite) resumes with the config's, said in one warning line. A schedule
whose state is not a saved schedule's, or at another step than its checkpoint, is one line too. A checkpoint
nobody touched resumes on the uninterrupted run's schedule, with every optim (torchao's in the slow tier)."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import torch
from resumes import argv, edit_optimizer, interrupted, keys, redo_checksums
from torch import nn

from hybridtune.config import load_config
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.checkpoint import CheckpointError
from hybridtune.run.resume import load_checkpoint
from hybridtune.runtime.optim import _Schedule, lr_lambda
from train_runs import metrics_rows, run

LR, WD, BETAS = 3e-3, 0.01, (0.9, 0.95)


def tamper(path, optim=None, schedule=None, meta=None, checksums=True):
    """Edit checkpoint `path` as an attacker with write access would: `optim(param_groups)` on DCP's optimizer
    groups, `schedule(state)` on trainer_state.pt's schedule, `meta(checkpoint.json)`, then every checksum redone."""
    if optim is not None:
        edit_optimizer(path, lambda state: optim(state["param_groups"]))
    if schedule is not None:
        trainer = torch.load(path / ckpt.STATE_FILE, weights_only=True)
        schedule(trainer["scheduler"])
        torch.save(trainer, path / ckpt.STATE_FILE)
    record = json.loads((path / ckpt.META_FILE).read_text())
    if meta is not None:
        meta(record)
    if checksums:
        redo_checksums(record, path)
    (path / ckpt.META_FILE).write_text(json.dumps(record))


def as_held(value: float):
    """`value` as a group holds it: torchao's optimizers hold their rates as tensors."""
    return lambda held: torch.tensor(value) if torch.is_tensor(held) else value


# -- the checkpoint alone: a small model, torch's AdamW, the run's cosine schedule -------------------------------


def parts(seed: int = 0, lr: float = LR, wd: float = WD, betas=BETAS):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 7))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas)
    return model, opt, _Schedule(opt, lr_lambda("cosine", 2, 10))


def steps(model, opt, sched, n: int) -> list[float]:
    rates = []
    for _ in range(n):
        model(torch.randn(5, 24)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        rates.append(opt.param_groups[0]["lr"])
    return rates


def saved_run(out, record: bool = True, **kw):
    """checkpoint-3 of a run built with the config `kw` changes, recording that config as the trainer does."""
    out.mkdir(parents=True, exist_ok=True)
    model, opt, sched = parts(**kw)
    steps(model, opt, sched, 3)
    config = {"learning_rate": kw.get("lr", LR), "weight_decay": kw.get("wd", WD)}
    extra = {"run": {"config": config, "resolved": {"learning_rate": config["learning_rate"]}}} if record else None
    ckpt.save_checkpoint(out / "checkpoint-3", model, opt, sched, 3, {"epoch": 0, "index": 3}, extra=extra)
    return out / "checkpoint-3"


def resumed(path, caplog, into=None) -> list[str]:
    """Resume `path` into `into` (default: this run's parts: the config's LR, WD, BETAS): the warnings it said."""
    model, opt, sched = into or parts(seed=1)
    with caplog.at_level(logging.WARNING):
        load_checkpoint(path, model, opt, sched)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def refused(path) -> str:
    model, opt, sched = parts(seed=1)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model, opt, sched)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint '{path}' cannot be resumed: "), msg
    return msg


def test_an_untouched_resume_follows_the_uninterrupted_schedule(tmp_path, caplog):
    model, opt, sched = parts()
    want = steps(model, opt, sched, 6)[3:]
    path = saved_run(tmp_path)
    model, opt, sched = parts(seed=1)
    assert resumed(path, caplog, (model, opt, sched)) == []
    assert steps(model, opt, sched, 3) == pytest.approx(want, rel=1e-12)


EDITS = {  # what an attacker edits -> (tamper's arguments, what the line must name)
    "lr": (dict(optim=lambda g: g[0].update(lr=10.0)), r"lr 10 where its schedule gives 0\.00\d+"),
    "initial_lr": (
        dict(optim=lambda g: g[0].update(initial_lr=10.0)),
        r"initial_lr 10 where its schedule gives 0\.003",
    ),
    "betas": (
        dict(optim=lambda g: g[0].update(betas=(0.1, 0.2))),
        r"betas \(0\.1, 0\.2\) where the config gives \(0\.9, 0\.95\)",
    ),
    "eps": (dict(optim=lambda g: g[0].update(eps=1.0)), r"eps 1 where the config gives 1e-08"),
    "weight_decay": (
        dict(optim=lambda g: g[0].update(weight_decay=0.5)),
        r"weight_decay 0\.5 where the config gives 0\.01",
    ),
    "amsgrad": (dict(optim=lambda g: g[0].update(amsgrad=True)), r"amsgrad True where the config gives False"),
    "every rate": (
        dict(
            optim=lambda g: g[0].update(lr=10.0, initial_lr=10.0),
            schedule=lambda s: s.update(base_lrs=[10.0], _last_lr=[10.0]),
        ),
        r"learning_rate 10 where the config gives 0\.003",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_hyperparameter_with_its_checksums_redone_is_refused_in_one_line(tmp_path, edit):
    kw, names = EDITS[edit]
    path = saved_run(tmp_path)
    tamper(path, **kw)
    assert ckpt.verify_checkpoint(path) is None  # the checksums pass: they were redone
    msg = refused(path)
    assert re.search(names, msg), msg
    assert "files were changed after the save" in msg and "resume from a checkpoint you trust" in msg, msg


def test_a_config_changed_since_its_run_resumes_with_the_configs_in_one_warning(tmp_path, caplog):
    """The record and the files agree on lr 0.05 and weight decay 0.5; the config (changed since, as --overwrite
    allows) says 0.003 and 0.01: the config's train, on the config's schedule from step 3 on."""
    model, opt, sched = parts()
    want = steps(model, opt, sched, 6)[3:]
    path = saved_run(tmp_path, lr=0.05, wd=0.5)
    model, opt, sched = parts(seed=1)
    said = resumed(path, caplog, (model, opt, sched))
    assert len(said) == 1 and said[0].startswith(f"resuming {path} with this run's config, changed since"), said
    assert (
        "learning_rate 0.05 where the config gives 0.003" in said[0]
        and "weight_decay 0.5 where the config gives 0.01" in said[0]
    )
    g = opt.param_groups[0]
    assert (g["weight_decay"], tuple(g["betas"]), sched.base_lrs) == (WD, BETAS, [LR])
    assert g["lr"] == pytest.approx(LR * lr_lambda("cosine", 2, 10)(3), rel=1e-12)
    assert steps(model, opt, sched, 3) == pytest.approx(want, rel=1e-12)


def test_without_a_run_record_a_rate_is_the_configs_and_a_constant_is_refused(tmp_path, caplog):
    path = saved_run(tmp_path / "a", record=False, lr=0.05)
    said = resumed(path, caplog)
    assert len(said) == 1 and "learning_rate 0.05 where the config gives 0.003" in said[0], said
    path = saved_run(tmp_path / "b", record=False, betas=(0.5, 0.5))
    assert "betas (0.5, 0.5) where the config gives (0.9, 0.95)" in refused(path)


SCHEDULES = {
    "another step": (
        dict(schedule=lambda s: s.update(last_epoch=5)),
        r"schedule is at step 5 but the checkpoint is at 3",
    ),
    "a method replaced": (dict(schedule=lambda s: s.update(step=3)), r"schedule sets 'step', which is not a saved"),
    "the optimizer replaced": (dict(schedule=lambda s: s.update(optimizer={})), r"sets 'optimizer'"),
    "a counter of another type": (
        dict(schedule=lambda s: s.update(_step_count="4")),
        r"_step_count is '4', where an int belongs",
    ),
    "a non-finite base rate": (dict(schedule=lambda s: s.update(base_lrs=[float("nan")])), r"base_lrs is \[nan\]"),
    "a rate function's state": (dict(schedule=lambda s: s.update(lr_lambdas=[{"x": 1}])), r"rate functions"),
    "checkpoint.json's step": (dict(meta=lambda m: m.update(step=2)), r"checkpoint.json is at step 2 but its"),
}


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_a_schedule_that_is_not_its_checkpoints_is_one_line(tmp_path, case):
    kw, pattern = SCHEDULES[case]
    path = saved_run(tmp_path)
    tamper(path, **kw)
    msg = refused(path)
    assert re.search(pattern, msg) and "its files disagree" in msg, msg


# -- the trainer: the tiny preset, interrupted after its first step, resumed through `hybridtune train` ----------

RATES = [1e-3 * lr_lambda("cosine", 2, 2)(s) for s in (0, 1)]  # the preset's learning_rate auto, over 2 steps


def resume(given: dict):
    return run(load_config(None, {**given, "resume_from_checkpoint": "latest"}))


def test_train_refuses_a_tampered_lr_in_one_line(copied, error_line):
    out, given = copied
    tamper(out / "checkpoint-1", optim=lambda g: g[0].update(lr=50.0))
    line = error_line(argv(given))
    assert f"checkpoint '{out / 'checkpoint-1'}' cannot be resumed" in line, line
    assert "lr 50 where its schedule gives 0.001" in line, line
    assert not (out / "checkpoint-2").exists() and not (out / "final").exists()


def test_train_refuses_a_rate_written_into_the_run_record_under_auto(copied, error_line):
    """`learning_rate: auto` resumes with the rate checkpoint.json's run record holds, and no checksum covers that
    file: a 50 there trained at 50 (the loss went from 5.5 to 5e4). The optimizer's own files say 0.001."""
    out, given = copied
    tamper(out / "checkpoint-1", meta=lambda m: m["run"]["resolved"].update(learning_rate=50.0), checksums=False)
    line = error_line(argv(given))
    assert "learning_rate 0.001 where the config gives 50" in line and "checkpoint.json" in line, line
    assert not (out / "checkpoint-2").exists()


def test_an_untouched_resume_trains_with_the_configs_rate(copied, caplog):
    out, given = copied
    with caplog.at_level(logging.WARNING):
        resume(given)
    assert "resuming" not in caplog.text and "cannot be resumed" not in caplog.text, caplog.text
    rates = [r["lr"] for r in metrics_rows(out, "train")]
    assert rates == pytest.approx(RATES, rel=1e-12) and (out / "checkpoint-2").is_dir(), rates


TORCHAO = pytest.mark.slow  # (torchao's compiled step: a CPU compile per run)


@pytest.mark.parametrize(
    "name", ["adamw", pytest.param("adamw_8bit", marks=TORCHAO), pytest.param("adamw_bf16_sr", marks=TORCHAO)]
)
def test_each_optim_refuses_a_tampered_lr_and_resumes_an_untouched_one(tmp_path, small_data, error_line, name, caplog):
    """A bf16 full fine-tune, where the optimizer decides how weights are held (adamw: MasterAdamW's fp32 masters;
    torchao's optimizers hold their rates as tensors, which the tamper keeps)."""
    if name != "adamw":
        pytest.importorskip("torchao.optim")
    kw = dict(adapter="full", bf16=True, optim=name)
    interrupted(tmp_path / "run", small_data, **kw)
    shutil.copytree(tmp_path / "run", tmp_path / "untouched")
    tamper(tmp_path / "run" / "checkpoint-1", optim=lambda g: g[0].update(lr=as_held(50.0)(g[0]["lr"])))
    assert "lr 50 where its schedule gives 0.001" in error_line(argv(keys(tmp_path / "run", small_data, **kw)))
    with caplog.at_level(logging.WARNING):
        resume(keys(tmp_path / "untouched", small_data, **kw))
    assert "resuming" not in caplog.text, caplog.text
    rates = [r["lr"] for r in metrics_rows(tmp_path / "untouched", "train")]
    assert rates == pytest.approx(RATES, rel=1e-6), rates
