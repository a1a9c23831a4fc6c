"""The `auto` defaults that follow from what the model is (runtime/defaults.py): a checkpoint trains at a
practitioner's learning rate for its adapter and at a sequence length from its data's lengths within its context,
each said in a `choice` line; a preset keeps the demo's values; a given value is kept; a resume keeps the values its
run decided, and what opens the run afterwards sees them too."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from checkpoints import fake_sha, hub_cache, make_checkpoint
from hybridtune.config import load_config
from hybridtune.data.build import covering_length
from hybridtune.infer.load import run_config
from hybridtune.models.hub import ModelSource
from hybridtune.runtime import defaults as dflt
from hybridtune.runtime.defaults import model_context, resolve_defaults
from hybridtune.train.trainer import Trainer

PRESET = ModelSource("tiny-qwen3_5", None)


def cfg_of(**kw):
    return load_config(None, {"output_dir": "/tmp/unused-run", **kw}, warn=False)


def test_covering_length_is_the_least_power_of_two_over_the_share():
    assert covering_length([10] * 99 + [1000], 0.99) == 16  # the one long example does not set the length
    assert covering_length([10] * 99 + [1000], 1.0) == 1024
    assert covering_length([17, 3], 1.0) == 32 and covering_length([16], 1.0) == 16
    assert covering_length([1], 1.0) == 2  # at least 2 (a bin holds a next-token pair)
    assert covering_length([5000], 0.99, cap=4096) == 4096  # never past the model's context
    assert covering_length([], 0.99, cap=512) == 512


def test_a_checkpoint_gets_a_rate_for_its_adapter_and_a_preset_the_demos():
    real = ModelSource("acme/tiny", Path("/nonexistent"), "abc")  # a checkpoint (no config.json: no context)
    lora = resolve_defaults(cfg_of(adapter="lora"), real, [20] * 10)
    full = resolve_defaults(cfg_of(adapter="full"), real, [20] * 10)
    assert (lora.learning_rate.value, full.learning_rate.value) == (2e-4, 1e-5)
    assert "LoRA on a checkpoint" in lora.learning_rate.reason and "full fine-tune" in full.learning_rate.reason
    assert resolve_defaults(cfg_of(adapter="lora"), PRESET, [20]).learning_rate.value == 1e-3
    demo = resolve_defaults(cfg_of(), PRESET, [20] * 10)
    assert (demo.learning_rate.value, demo.sequence_len.value) == (1e-3, 256)
    given = resolve_defaults(cfg_of(learning_rate=5e-5, sequence_len=128), real, [200, 20])
    assert (given.learning_rate.value, given.sequence_len.value) == (5e-5, 128)
    assert given.sequence_len.reason == "given; 50.0% of the 2 training examples fit whole (longest 200 tokens)"


def test_sequence_len_from_the_lengths_within_the_models_context(tmp_path):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl")  # the context sits in config.json's text_config
    source = ModelSource(str(ckpt), ckpt)
    assert model_context(source) == 4096
    lengths = [300] * 95 + [900] * 5
    alone = cfg_of(sample_packing=False)  # the length holding the examples (packing raises it: test_packing_defaults)
    c = resolve_defaults(alone, source, lengths).sequence_len
    assert c.value == 1024 and "100.0% of the 100 training examples fit whole" in c.reason
    c = resolve_defaults(alone, source, [300] * 99 + [900] * 2).sequence_len
    assert c.value == 1024  # 99% of 101 needs the 100th: one long one
    c = resolve_defaults(alone, source, [300] * 200 + [900]).sequence_len
    assert c.value == 512 and "99.5% of the 201 training examples fit whole (longest 900 tokens)" in c.reason
    config = json.loads((ckpt / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = 256
    (ckpt / "config.json").write_text(json.dumps(config))
    c = resolve_defaults(alone, source, [300] * 10).sequence_len
    assert c.value == 256 and "the model's context (max_position_embeddings 256)" in c.reason
    assert "0.0% of the 10 training examples fit whole" in c.reason


@pytest.fixture
def hub_model(tmp_path, monkeypatch):
    """A tiny checkpoint as the hub cache holds `acme/tiny`, offline, and chat data of short rows."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text")
    monkeypatch.setenv("HF_HOME", str(hub_cache(tmp_path, "acme/tiny", ckpt, fake_sha("main"))))
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": str(2 * i)}]}
        for i in range(24)
    ]
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return data


def test_a_hub_checkpoint_trains_at_the_auto_defaults_and_a_resume_keeps_them(tmp_path, hub_model, caplog, monkeypatch):
    out = tmp_path / "out"
    keys = dict(base_model="acme/tiny", dataset=str(hub_model), adapter="lora", output_dir=str(out), max_steps=2,
                save_steps=1, eval_steps=0, val_set_size=2, warmup_steps=0)  # fmt: skip
    caplog.set_level(logging.INFO, logger="hybridtune")
    t = Trainer(load_config(None, keys))
    t.setup()
    t.train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("choice ")]
    assert "choice learning_rate: 0.0002 (auto: LoRA on a checkpoint, as practitioners start it)" in lines
    seq = next(line for line in lines if line.startswith("choice sequence_len: "))
    assert seq.startswith("choice sequence_len: 32 (auto: the smallest power of two holding 99% of them, within the "
                          "model's context of 4096; 100.0% of the 22 training examples fit whole (longest ")  # fmt: skip
    assert t.cfg.sequence_len == 32 and t.optimizer.param_groups[0]["initial_lr"] == 2e-4
    run = json.loads((out / "hybridtune_run.json").read_text())
    assert run["config"]["learning_rate"] == "auto" and run["resolved"] == {"learning_rate": 2e-4, "sequence_len": 32}
    meta = json.loads((out / "checkpoint-1" / "checkpoint.json").read_text())
    assert meta["run"]["resolved"] == run["resolved"]
    # What opens the run sees the numbers it trained with (eval's --split heldout, the card, a checkpoint's model).
    opened = run_config(meta["run"], out)
    assert (opened.learning_rate, opened.sequence_len) == (2e-4, 32)
    # A resume takes the recorded values even where the rule would now decide otherwise.
    monkeypatch.setattr(dflt, "COVER", 0.01)
    monkeypatch.setattr(dflt, "LORA_LEARNING_RATE", 1e-4)
    assert resolve_defaults(load_config(None, keys), t.source, [5] * 21 + [20]).sequence_len.value == 8
    assert dflt.choose_learning_rate(load_config(None, keys), False, {}).value == 1e-4
    caplog.clear()
    r = Trainer(load_config(None, {**keys, "resume_from_checkpoint": str(out / "checkpoint-1"), "overwrite": True}))
    r.setup()
    assert (r.cfg.learning_rate, r.cfg.sequence_len) == (2e-4, 32)
    assert "choice learning_rate: 0.0002 (auto: as the run this resumes decided it)" in caplog.text
    r.close()


def test_a_run_from_before_auto_resumes_with_its_recorded_numbers():
    """A run recorded learning_rate 0.001 and sequence_len 256 as numbers (the defaults before `auto`): the same
    command now (both `auto`) is the same run, and it continues with those numbers."""
    from hybridtune.config import TrainConfig, to_dict
    from hybridtune.run.outdir import changes
    from hybridtune.runtime.defaults import recorded_values

    old = to_dict(TrainConfig()) | {"learning_rate": 0.001, "sequence_len": 256}
    held = {"config": old}
    assert changes(held, TrainConfig(), (), {}) == []
    assert recorded_values(held) == {"learning_rate": 0.001, "sequence_len": 256}
    other = to_dict(TrainConfig()) | {"learning_rate": 0.001, "sequence_len": 256, "lora_r": 64}
    assert changes({"config": other}, TrainConfig(), (), {}) == ["lora_r: 64 -> 16"]
