"""Packed attention on CUDA under bf16 autocast: q/k leave fp32 norms, the varlen kernel needs 16-bit."""

from __future__ import annotations

import pytest
import torch

from hybridtune.mixers.attention.varlen import _half_dtype


def test_half_dtype_follows_the_projection_output():
    f32 = torch.zeros(1, dtype=torch.float32)
    bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert _half_dtype(f32, bf16) is torch.bfloat16  # autocast: q normed in fp32, v from a bf16 matmul
    assert _half_dtype(bf16, bf16) is torch.bfloat16
    assert _half_dtype(f32, f32) is None  # fp32 training: SDPA fallback


@pytest.mark.cuda
def test_packed_forward_under_autocast_matches_per_document():
    from transformers import AutoModelForCausalLM

    from hybridtune.data import Example, PackedCollator
    from hybridtune.models.patching import patch_model
    from hybridtune.models.presets import preset_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).cuda().eval()
    patch_model(model)
    lens = [37, 64, 5, 90]
    docs = [Example(torch.randint(0, 256, (n,)).tolist(), [1] * n) for n in lens]
    batch = {k: (v.cuda() if torch.is_tensor(v) else v) for k, v in PackedCollator()(docs).items()}
    keys = (
        "input_ids",
        "position_ids",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "gdn_chunk_indices",
    )
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        packed = model(**{k: batch[k] for k in keys}).logits.float()
        start = 0
        for n, d in zip(lens, docs):
            alone = model(input_ids=torch.tensor([d.input_ids], device="cuda")).logits.float()
            err = (packed[:, start : start + n] - alone).norm() / alone.norm()
            assert err < 2e-2, (n, float(err))  # bf16 kernels on both sides, different tilings
            start += n
