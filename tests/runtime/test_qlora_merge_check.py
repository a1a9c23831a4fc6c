"""Whether a QLoRA adapter's base already holds NF4's values is read from its weights, never from a file beside
them (a red team planted the old `dequantized.json` marker in a bf16 base: merge then folded the adapter into
weights it never trained on). NF4's values come back through NF4 within NF4_VALUES_RTOL (the double-quantised
scale's drift and a rounding); a weight not yet quantised never does, in bf16 or fp32, at odd shapes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybridtune.models.presets import preset_config
from hybridtune.ops import nf4
from hybridtune.runtime import quant

pytest.importorskip("torchao")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,seed", [((64, 192), 0), ((320, 448), 1), ((3, 128, 64), 2), ((1024, 576), 3)])
def test_nf4_values_are_told_from_weights_not_yet_quantised(shape, seed, dtype):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(shape, generator=g) * 0.02 * (1 + torch.rand(shape, generator=g))).to(dtype)
    once = nf4.roundtrip(w)
    assert not quant.holds_nf4_values(w, once)  # a fresh weight moves
    twice = nf4.roundtrip(once)
    assert quant.holds_nf4_values(once, twice)  # NF4's values stay within the tolerance
    assert not torch.equal(w, once)


def test_roundtrip_targets_rounds_a_plain_base_and_keeps_a_dequantised_one(tmp_path):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).to(torch.bfloat16)
    names = quant.targets(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    (tmp_path / "dequantized.json").write_text('{"dequantized_from": "nf4"}')  # the old marker: read by nothing
    rounded, kept = quant.roundtrip_targets(model)
    assert (rounded, kept) == (len(names), 0) and rounded > 0
    after = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
    assert all(not torch.equal(before[n], after[n]) for n in names)
    assert all(torch.equal(after[n], nf4.roundtrip(before[n])) for n in names)
    # the same model again: it holds NF4's values now, so nothing moves (a base_model/ written dequantised)
    assert quant.roundtrip_targets(model) == (0, len(names))
    assert all(torch.equal(after[n], p) for n, p in model.named_parameters() if n in names)
