"""Presets built in a 16-bit dtype: parameters in that dtype, buffers as transformers builds them (rotary inv_freq
in fp32), tied weights still tied, and the same weights as the fp32 build rounded."""

from __future__ import annotations

import torch

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
