"""`gradient_checkpointing: auto`: off by default; a first step that runs out of memory is retried once with
checkpointing on, on the same data, and the run then follows the curve of a run that started with it on."""

from __future__ import annotations

import logging

import torch

from hybridtune.train.trainer import Trainer
from train_runs import make_cfg


def _cfg(out, data, gc):
    return make_cfg(
        out,
        data,
        max_steps=3,
        val_set_size=0,
        warmup_steps=1,
        lora_dropout=0.0,
        compile="off",
        gradient_checkpointing=gc,
    )


def _checkpointed(t: Trainer) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in t.model.modules())


class _OomOnce:
    """The engine, raising CUDA's out-of-memory error on its first call (as a too-large first step would)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return self.engine(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def test_auto_retries_an_out_of_memory_first_step_with_checkpointing(tmp_path, small_data, caplog):
    on = Trainer(_cfg(tmp_path / "on", small_data, True))
    on.setup()
    ref = on.train()
    assert _checkpointed(on)

    auto = Trainer(_cfg(tmp_path / "auto", small_data, "auto"))
    auto.setup()
    assert not _checkpointed(auto)  # auto starts without recompute
    auto.composed.engine = _OomOnce(auto.composed.engine)  # what the step calls (runtime.compose.backward)
    with caplog.at_level(logging.WARNING, logger="hybridtune.train.trainer"):
        got = auto.train()
    assert auto.composed.engine.calls > 1 and _checkpointed(auto)
    assert any("ran out of GPU memory" in r.getMessage() for r in caplog.records)
    # The retried step read the same packs: the curve is the one of the run that had checkpointing from the start.
    assert len(got.losses) == len(ref.losses) == 3
    assert max(abs(a - b) / abs(b) for a, b in zip(got.losses, ref.losses)) < 1e-5, (got.losses, ref.losses)


def test_auto_without_memory_pressure_stays_off(tmp_path, small_data):
    t = Trainer(_cfg(tmp_path / "off", small_data, "auto"))
    t.setup()
    res = t.train()
    assert res.steps == 3 and not _checkpointed(t)
