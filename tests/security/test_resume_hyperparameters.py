"""A resume trains with the run's config, not with what a checkpoint's files say: a checkpoint whose optimizer groups
or schedule hold another learning rate, weight decay or betas (edited by hand with its checksums redone, or written
under another config) resumed silently with them (red team: a tampered lr trained on). Now the config's values are
set back after loading, each difference said in one warning line; a schedule whose step disagrees with the
checkpoint's is one CheckpointError line."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from hybridtune.run import checkpoint as ckpt
from hybridtune.run.checkpoint import CheckpointError
from hybridtune.runtime.optim import _Schedule, lr_lambda

LR, WD, BETAS = 3e-3, 0.01, (0.9, 0.95)


def parts(seed: int = 0, lr: float = LR, wd: float = WD, betas=BETAS):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 7))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=betas)
    return model, opt, _Schedule(opt, lr_lambda("cosine", 2, 10))


def run(model, opt, sched, steps: int) -> list[float]:
    rates = []
    for _ in range(steps):
        model(torch.randn(5, 24)).pow(2).mean().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
        rates.append(opt.param_groups[0]["lr"])
    return rates


def saved_run(out, **kw):
    """checkpoint-3 of a run built with the config `kw` changes (as a hand-edited checkpoint would hold)."""
    model, opt, sched = parts(**kw)
    run(model, opt, sched, 3)
    ckpt.save_checkpoint(out / "checkpoint-3", model, opt, sched, 3, {"epoch": 0, "index": 3})
    return out / "checkpoint-3"


def test_an_untouched_resume_follows_the_uninterrupted_schedule(tmp_path, caplog):
    model, opt, sched = parts()
    want = run(model, opt, sched, 6)[3:]
    path = saved_run(tmp_path)
    model, opt, sched = parts(seed=1)
    with caplog.at_level(logging.WARNING):
        ckpt.load_checkpoint(path, model, opt, sched)
    assert not [r for r in caplog.records if "resumed with" in r.getMessage()]
    assert run(model, opt, sched, 3) == pytest.approx(want, rel=1e-12)


def test_a_checkpoint_holding_other_hyperparameters_resumes_with_the_configs(tmp_path, caplog):
    model, opt, sched = parts()
    want = run(model, opt, sched, 6)[3:]
    path = saved_run(tmp_path, lr=10.0, wd=0.5, betas=(0.1, 0.2))  # what a tampered checkpoint held
    model, opt, sched = parts(seed=1)
    with caplog.at_level(logging.WARNING):
        ckpt.load_checkpoint(path, model, opt, sched)
    said = [r.getMessage() for r in caplog.records if "resumed with" in r.getMessage()]
    assert any(m.startswith("resumed with the config's learning rate 0.003 (the checkpoint's schedule held 10")
               for m in said), said  # fmt: skip
    assert any("weight_decay 0.01 (the checkpoint held 0.5" in m for m in said)
    assert any("betas (0.9, 0.95) (the checkpoint held (0.1, 0.2)" in m for m in said)
    g = opt.param_groups[0]
    assert (g["weight_decay"], tuple(g["betas"]), sched.base_lrs) == (WD, BETAS, [LR])
    assert g["lr"] == pytest.approx(LR * lr_lambda("cosine", 2, 10)(3), rel=1e-12)
    assert run(model, opt, sched, 3) == pytest.approx(want, rel=1e-12)  # the config's schedule from step 3 on


def test_a_schedule_at_another_step_than_its_checkpoint_is_one_line(tmp_path):
    model, opt, sched = parts()
    run(model, opt, sched, 3)
    ckpt.save_checkpoint(tmp_path / "checkpoint-5", model, opt, sched, 5, {"epoch": 0, "index": 5})  # sched at 3
    model, opt, sched = parts(seed=1)
    with pytest.raises(CheckpointError, match=r"schedule is at step 3 but the checkpoint at step 5") as e:
        ckpt.load_checkpoint(tmp_path / "checkpoint-5", model, opt, sched)
    assert "\n" not in str(e.value)
