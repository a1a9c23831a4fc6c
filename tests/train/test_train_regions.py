"""`hybridtune train`'s default compiled loop in one process is regional (`compile_regions: auto`): the real
trainer, the real compile_loop (torch.compile under aot_eager: inductor's CPU build would cost minutes; its
regional gradients are tests/compiler/test_loop_regions.py's), the static layout, gradient accumulation and the
evaluations between steps. The run's training and eval losses are those of the same run uncompiled, and of the
same run with every layer inlined."""

from __future__ import annotations

import pytest
import torch

from hybridtune.train.trainer import Trainer
from train_runs import run_static


def test_train_default_loop_is_regional_and_trains_as_uncompiled(tmp_path, small_data, aot_eager):
    _, plain = run_static(tmp_path / "off", small_data, compile="off")
    t, regional = run_static(tmp_path / "regions", small_data, compile="loop")
    assert t.choices.compile_regions.value is True
    assert aot_eager[-1].regions is not None and aot_eager[-1].regions.regional
    _, inlined = run_static(tmp_path / "inlined", small_data, compile="loop", compile_regions=False)
    assert aot_eager[-1].regions is None or not aot_eager[-1].regions.regional
    assert len(regional.losses) == 3 and len(regional.evals) >= 1
    for other in (plain, inlined):
        assert regional.losses == pytest.approx(other.losses, rel=1e-5, abs=0)
        for a, b in zip(regional.evals, other.evals, strict=True):
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)


def test_eval_generations_after_regional_training(tmp_path, small_data, aot_eager):
    """Greedy generations (the upstream forward with a cache, through the regions' installed layer forwards) after
    training under the regional loop are those of the uncompiled run."""
    kw = dict(eval_samples=2, eval_max_new_tokens=4)
    _, plain = run_static(tmp_path / "off", small_data, max_steps=2, compile="off", **kw)
    t, regional = run_static(tmp_path / "reg", small_data, max_steps=2, compile="loop", **kw)
    assert t.choices.compile_regions.value is True and aot_eager[-1].regions.regional
    assert regional.losses == pytest.approx(plain.losses, rel=1e-5)
    a, b = regional.evals[-1], plain.evals[-1]
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    assert len(a["samples"]) == 2
    assert [s["generated"] for s in a["samples"]] == [s["generated"] for s in b["samples"]]


def test_oom_retry_keeps_the_regional_loop(tmp_path, small_data, aot_eager, monkeypatch):
    """The first step's out-of-memory retry (gradient_checkpointing: auto) switches checkpointing on after the
    regional loop was compiled; the retried run stays regional and trains as the uncompiled checkpointed run."""
    real = Trainer.train_step
    calls = []

    def flaky(self):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(self)

    _, plain = run_static(tmp_path / "off", small_data, max_steps=2, compile="off", gradient_checkpointing=True)
    monkeypatch.setattr(Trainer, "train_step", flaky)
    t, regional = run_static(tmp_path / "reg", small_data, max_steps=2, compile="loop", gradient_checkpointing="auto")
    assert t.choices.checkpointing.value is False and len(calls) >= 2  # the retry ran
    regs = aot_eager[-1].regions
    assert regs is not None and regs.regional
    assert any(getattr(m, "gradient_checkpointing", False) for m in t.model.modules())  # switched on by the retry
    assert regional.losses == pytest.approx(plain.losses, rel=1e-5)
