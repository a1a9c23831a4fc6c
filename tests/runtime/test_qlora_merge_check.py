"""Whether a QLoRA adapter's base already holds NF4's values is read from its weights, never from a file beside
them (a red team planted the old `dequantized.json` marker in a bf16 base: merge then folded the adapter into
weights it never trained on). NF4's values come back through NF4 with their codes, each block's scale drifting by
about a bf16 rounding (well within NF4_VALUES_TOL of the block's largest value); a weight not yet quantised never
does, in bf16 or fp32, at odd shapes, normal, heavy-tailed or with outlier blocks."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from checkpoints import make_checkpoint
from hybridtune.models.presets import preset_config
from hybridtune.ops import nf4
from hybridtune.run.checkpoint import FINAL_META
from hybridtune.run.merge import merge
from hybridtune.runtime import quant

pytest.importorskip("torchao")

SHAPES = [((64, 192), 0), ((320, 448), 1), ((3, 128, 64), 2), ((1024, 576), 3)]


def _weight(shape, seed, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.02 * (1 + torch.rand(shape, generator=g))
    if kind == "heavy-tailed":  # Student-t with 3 degrees of freedom: rare large values, as real weights have
        w = w / (torch.randn(3, *shape, generator=g).pow(2).mean(0)).sqrt()
    elif kind == "outlier-blocks":  # one block in 50 twenty times larger
        big = torch.rand(w.numel() // nf4.BLOCK, 1, generator=g) < 0.02
        w = (w.reshape(-1, nf4.BLOCK) * (1 + 19 * big)).reshape(shape)
    return w


def _block_move(w, r):
    w, r = w.float().reshape(-1, nf4.BLOCK), r.float().reshape(-1, nf4.BLOCK)
    return float(((r - w).abs().amax(1) / w.abs().amax(1)).max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,seed", SHAPES)
def test_nf4_values_are_told_from_weights_not_yet_quantised(shape, seed, dtype):
    w = _weight(shape, seed).to(dtype)
    once = nf4.roundtrip(w)
    assert not quant.holds_nf4_values(w, once)  # a fresh weight moves
    assert _block_move(w, once) > 4 * quant.NF4_VALUES_TOL  # by far more than the tolerance
    twice = nf4.roundtrip(once)
    assert quant.holds_nf4_values(once, twice)  # NF4's values stay within the tolerance
    assert _block_move(once, twice) <= quant.NF4_VALUES_TOL / 2  # with a margin
    # one block put back to its unquantised values is enough to tell
    mixed = once.clone().reshape(-1, nf4.BLOCK)
    mixed[len(mixed) // 2] = w.reshape(-1, nf4.BLOCK)[len(mixed) // 2]
    mixed = mixed.reshape(shape)
    assert not quant.holds_nf4_values(mixed, nf4.roundtrip(mixed))


@pytest.mark.parametrize("kind", ["heavy-tailed", "outlier-blocks"])
@pytest.mark.parametrize("shape,seed", SHAPES)
def test_weights_not_yet_quantised_never_pass_for_nf4_values(shape, seed, kind):
    for dtype in (torch.bfloat16, torch.float32):
        w = _weight(shape, seed, kind).to(dtype)
        assert not quant.holds_nf4_values(w, nf4.roundtrip(w))


def test_roundtrip_targets_rounds_a_plain_base_and_keeps_a_dequantised_one():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).to(torch.bfloat16)
    names = quant.targets(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    rounded, kept = quant.roundtrip_targets(model)
    assert (rounded, kept) == (len(names), 0) and rounded > 0
    after = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    assert all(not torch.equal(before[n], after[n]) for n in names)
    assert all(torch.equal(after[n], nf4.roundtrip(before[n])) for n in names)
    # the same model again: it holds NF4's values now, so nothing moves (a base_model/ written dequantised)
    assert quant.roundtrip_targets(model) == (0, len(names))
    assert all(torch.equal(after[n], p) for n, p in model.named_parameters() if n in names)


def _qlora_adapter(tmp_path, base_dir):
    """A LoRA adapter on `base_dir` (q_proj and in_proj_z, non-zero B) whose final/hybridtune.json says it trained
    on the NF4 base, as a QLoRA run's does."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "in_proj_z"], init_lora_weights=False)
    adapter = tmp_path / "adapter"
    get_peft_model(model, cfg).save_pretrained(str(adapter))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base_dir)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    (adapter / FINAL_META).write_text(json.dumps({"adapter": "lora", "base_quantization": quant.QUANTIZATION}))
    return adapter


def _params(path):
    return dict(AutoModelForCausalLM.from_pretrained(str(path)).named_parameters())


def test_a_planted_marker_does_not_change_a_qlora_merge(tmp_path, caplog):
    """A bf16 checkpoint with the old `dequantized.json` planted in it merges exactly as without it: through NF4
    (one warning says the file is ignored). A base that does hold NF4's values (what a QLoRA run's base_model/
    holds) is kept as it is, and merges to the same model."""
    from peft import PeftModel

    base_dir = make_checkpoint(tmp_path, "qwen3_5_text", torch.bfloat16)
    adapter = _qlora_adapter(tmp_path, base_dir)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        clean = _params(merge(adapter, tmp_path / "clean"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    (base_dir / quant.LEGACY_MARKER).write_text(json.dumps({"dequantized_from": "nf4"}))  # the red team's plant
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        planted = _params(merge(adapter, tmp_path / "planted"))
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and quant.LEGACY_MARKER in warned[0] and "do not" in warned[0], warned
    assert clean.keys() == planted.keys()
    assert all(torch.equal(clean[n], planted[n]) for n in clean)

    # What it equals: the adapter folded into the base's NF4 values (not into the bf16 weights)
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    bf16 = {n: p.detach().clone() for n, p in base.named_parameters()}
    nf4_names = quant.targets(base)
    quant.roundtrip_targets(base)
    nf4_dir = tmp_path / "nf4_base"
    base.save_pretrained(str(nf4_dir))  # the base's NF4 values, dequantised: what a QLoRA run's base_model/ holds
    want = dict(PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().named_parameters())
    assert all(torch.equal(clean[n], want[n]) for n in clean)
    untouched = next(n for n in nf4_names if "mlp.down_proj" in n)  # no LoRA on it: its NF4 values, as trained on
    assert torch.equal(clean[untouched], nf4.roundtrip(bf16[untouched]))
    assert not torch.equal(clean[untouched], bf16[untouched])
    adapted = next(n for n in nf4_names if "q_proj" in n)
    assert (clean[adapted].float() - nf4.roundtrip(bf16[adapted]).float()).abs().max() > 1e-3  # the adapter is in

    # A base holding NF4's values (with the marker the old export wrote): kept as it is, no warning, the same model
    (nf4_dir / quant.LEGACY_MARKER).write_text(json.dumps({"dequantized_from": "nf4"}))
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(nf4_dir)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        kept = _params(merge(adapter, tmp_path / "kept"))
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("0 base weights through NF4 and back" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(clean[n], kept[n]) for n in clean)
