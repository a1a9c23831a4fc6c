"""`pack_layout: static` trains on the same curve as `dynamic` (fillers are invisible to the documents and to
the loss), logs the documents' own token counts, and evaluates the same."""

from __future__ import annotations

from hybridtune.config import load_config
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg


def _run(out, data, layout):
    cfg = make_cfg(
        out,
        data,
        sequence_len=96,
        max_steps=4,
        eval_steps=2,
        val_set_size=10,
        warmup_steps=1,
        lora_dropout=0.0,
        pack_layout=layout,
    )
    recs = []
    t = Trainer(cfg, on_log=recs.append)
    t.setup()
    return t, t.train(), recs


def test_static_layout_follows_the_dynamic_curve(tmp_path, small_data):
    td, dyn, recs_d = _run(tmp_path / "d", small_data, "dynamic")
    ts, sta, recs_s = _run(tmp_path / "s", small_data, "static")
    assert td.collate.layout is None and ts.collate.layout is not None
    T = ts.collate.layout.tokens
    assert all(r["tokens"] <= 2 * T for r in recs_s)
    assert [r["tokens"] for r in recs_s] == [r["tokens"] for r in recs_d]
    assert max(abs(a - b) / abs(b) for a, b in zip(sta.losses, dyn.losses)) < 1e-5, (sta.losses, dyn.losses)
    assert len(sta.evals) == len(dyn.evals) >= 2
    for a, b in zip(sta.evals, dyn.evals):
        assert a["eval_examples"] == b["eval_examples"] == 10 and a["exact_match"] == b["exact_match"]
        assert abs(a["eval_loss"] - b["eval_loss"]) / b["eval_loss"] < 1e-5


def test_auto_takes_static_only_under_a_compile_and_within_the_filler_limit(tmp_path, small_data, monkeypatch):
    import dataclasses

    import pytest

    from hybridtune.errors import ConfigError
    from hybridtune.runtime import choices

    cfg = load_config(None, dict(dataset=small_data, sequence_len=96, max_steps=1, output_dir=str(tmp_path / "a")))
    t = Trainer(cfg)
    t.setup()  # CPU: compile auto = off, so the layout is dynamic
    assert t.collate.layout is None and "without a compile" in t.choices.pack_layout.reason
    facts = t._facts(t.model)  # every train and eval pack of this run

    def layout(strategy: str, **over):
        return choices.choose_pack_layout(dataclasses.replace(cfg, **over), facts, strategy)

    assert layout("loop").value is not None  # the bundled-style chats fit within the limit
    assert layout("modules").value is not None  # per-class forwards: one compile per class
    monkeypatch.setattr(choices, "AUTO_MAX_FILLER", 0.0)  # no static layout has zero filler: auto falls back
    got = layout("loop")
    assert got.value is None and "would cost more than 0%" in got.reason
    monkeypatch.undo()
    assert layout("loop", micro_batch_size=2).value is None
    with pytest.raises(ConfigError, match="micro_batch_size 1"):
        layout("loop", micro_batch_size=2, pack_layout="static")
