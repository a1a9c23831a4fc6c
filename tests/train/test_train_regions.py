"""`hybridtune train`'s default compiled loop in one process is regional (`compile_regions: auto`): the real
trainer, the real compile_loop (torch.compile under aot_eager: inductor's CPU build would cost minutes; its
regional gradients are tests/compiler/test_loop_regions.py's), the static layout, gradient accumulation and the
evaluations between steps. The run's training and eval losses are those of the same run uncompiled, and of the
same run with every layer inlined."""

from __future__ import annotations

import pytest
import torch
from test_resume import make_cfg

from hybridtune.train.trainer import Trainer


def run(out, data, max_steps=3, **kw):
    """The trainer's run of `kw` over `data` in `out` (static layout, eval every 2 steps); (trainer, result)."""
    cfg = make_cfg(out, data, max_steps=max_steps, eval_steps=2, lora_dropout=0.0, pack_layout="static", **kw)
    t = Trainer(cfg)
    t.setup()
    try:
        return t, t.train()
    finally:
        torch._dynamo.reset()


def test_train_default_loop_is_regional_and_trains_as_uncompiled(tmp_path, small_data, aot_eager):
    _, plain = run(tmp_path / "off", small_data, compile="off")
    t, regional = run(tmp_path / "regions", small_data, compile="loop")
    assert t.choices.compile_regions.value is True
    assert aot_eager[-1].regions is not None and aot_eager[-1].regions.regional
    _, inlined = run(tmp_path / "inlined", small_data, compile="loop", compile_regions=False)
    assert aot_eager[-1].regions is None or not aot_eager[-1].regions.regional
    assert len(regional.losses) == 3 and len(regional.evals) >= 1
    for other in (plain, inlined):
        assert regional.losses == pytest.approx(other.losses, rel=1e-5, abs=0)
        for a, b in zip(regional.evals, other.evals, strict=True):
            assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
