"""Loading. Presets built in a 16-bit dtype: parameters in that dtype, buffers as transformers builds them (rotary
inv_freq in fp32), tied weights still tied, and the same weights as the fp32 build rounded; a preset warns that its
weights are random. Checkpoints of every kind (tests/checkpoints.py) load in their original class with their saved
weights; a vision tower is frozen and stays in its saved dtype while `dtype` applies to the text model."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from checkpoints import ARCHITECTURES, KINDS, VL_KINDS, make_checkpoint, read_tensors
from hybridtune.errors import ModelError
from hybridtune.models.loading import load_model


def test_bf16_preset_keeps_fp32_buffers_and_the_fp32_weights_rounded():
    half = load_model("tiny-qwen3_5", dtype=torch.bfloat16).model
    full = load_model("tiny-qwen3_5").model
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16} and half.config.dtype == torch.bfloat16
    buffers = dict(half.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for n, b in buffers.items() if "inv_freq" in n)
    assert half.lm_head.weight is half.model.embed_tokens.weight
    for (n, a), (_, b) in zip(half.named_parameters(), full.named_parameters()):
        assert torch.equal(a, b.to(torch.bfloat16)), n


# -- checkpoints in their original class -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_loads_in_its_original_class_with_its_weights(tmp_path, kind):
    ckpt = make_checkpoint(tmp_path, kind, torch.bfloat16)
    loaded = load_model(str(ckpt))
    model = loaded.model
    assert type(model).__name__ == ARCHITECTURES[kind]
    assert (loaded.name, loaded.source_dir, loaded.revision) == (str(ckpt), ckpt, None)
    assert loaded.source_dtype == torch.bfloat16 and not loaded.random_init and loaded.source == "checkpoint"
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, "dtype None: as saved"
    # Every saved tensor but `mtp.*` (which transformers does not load) is in the model, unchanged; MoE experts are
    # saved per expert and held fused, so they are compared through save_pretrained's inverse below.
    saved = read_tensors(ckpt)
    state = model.state_dict()
    plain = {k: v for k, v in saved.items() if not k.startswith("mtp.") and ".mlp.experts." not in k}
    assert plain and all(torch.equal(state[k], v) for k, v in plain.items())
    # save_pretrained writes the original tree back: every key of the source but `mtp.*`, bit for bit.
    model.save_pretrained(tmp_path / "again")
    again = read_tensors(tmp_path / "again")
    assert set(again) == {k for k in saved if not k.startswith("mtp.")}
    assert all(torch.equal(again[k], saved[k]) for k in again)


@pytest.mark.parametrize("kind", VL_KINDS)
def test_the_vision_tower_is_frozen_and_stays_as_saved_while_the_text_model_takes_dtype(tmp_path, kind):
    ckpt = make_checkpoint(tmp_path, kind, torch.bfloat16)
    model = load_model(str(ckpt), dtype=torch.float32).model
    vision = dict(model.model.visual.named_parameters())
    assert vision and all(not p.requires_grad and p.dtype == torch.bfloat16 for p in vision.values())
    text = {n: p for n, p in model.named_parameters() if ".visual." not in n}
    assert text and all(p.requires_grad and p.dtype == torch.float32 for p in text.values())
    assert model.lm_head.weight.requires_grad
    assert all(b.dtype == torch.float32 for n, b in model.named_buffers() if "inv_freq" in n)


def test_a_preset_says_loudly_that_its_weights_are_random(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        loaded = load_model("tiny-qwen3_5", seed=7)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "weights are RANDOM (seed 7)" in warnings[0] and "hub id" in warnings[0]
    assert loaded.random_init and loaded.source_dir is None and loaded.source_dtype == torch.float32
    assert loaded.name == "tiny-qwen3_5" and loaded.source == "preset"
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        load_model(str(make_checkpoint(tmp_path, "qwen3_5_text")))
    assert not [r for r in caplog.records if "RANDOM" in r.getMessage()]


def test_a_damaged_checkpoint_is_one_line(tmp_path):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text")
    weights = ckpt / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ModelError, match=r"a weight file is damaged or incomplete .*; download or copy it again"):
        load_model(str(ckpt))
    weights.write_bytes(whole)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | {"hidden_size": 32}))
    with pytest.raises(ModelError, match=r"the shapes of its weights do not match its config.json"):
        load_model(str(ckpt))


def test_an_index_listing_tensors_its_files_lack_is_one_line_at_load(tmp_path):
    """An export reads the source's untouched tensors back through its index: a tensor the index lists but its
    file lacks was found only after training, as a traceback at the export (exit 1, no final/)."""
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl")
    index = ckpt / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    last = sorted(set(meta["weight_map"].values()))[-1]
    index.write_text(json.dumps(meta | {"weight_map": meta["weight_map"] | {"mtp.ghost.weight": last}}))
    with pytest.raises(ModelError, match=rf"lists 1 tensor\(s\) \(e.g. mtp.ghost.weight\) in {last}, which does not"):
        load_model(str(ckpt))
