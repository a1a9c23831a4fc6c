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


def test_two_d_padding_mask_over_a_static_cache_sees_only_written_past_keys():
    """The SDPA fallback's flash-style 2-D mask [B, L] (the L tokens so far) over S >= L keys (a static cache's
    unwritten slots at the end): each query sees the unpadded keys up to its own position and nothing after L,
    equal to attention computed directly on the keys it may see (fp64), for a prefill (T = L) and a decode step
    (T = 1), with left padding."""
    import math
    from types import SimpleNamespace

    from hybridtune.mixers.attention.varlen import _sdpa_fallback

    g = torch.Generator().manual_seed(0)
    B, H, D, S = 3, 2, 8, 13
    module = SimpleNamespace(is_causal=True, num_key_value_groups=1, training=False)
    for L, T in ((7, 7), (9, 1)):
        q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
        v = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
        mask = torch.ones(B, L, dtype=torch.long)
        mask[1, :2] = 0  # left padding
        mask[2, :4] = 0
        got, _ = _sdpa_fallback(module, q, k, v, mask, 1 / math.sqrt(D), 0.0)
        for b in range(B):
            for t in range(T):
                pos = L - T + t
                keep = [j for j in range(pos + 1) if mask[b, j]]
                w = (torch.einsum("hd,hkd->hk", q[b, :, t], k[b, :, keep]) / math.sqrt(D)).softmax(-1)
                want = torch.einsum("hk,hkd->hd", w, v[b, :, keep])
                torch.testing.assert_close(got[b, t], want, rtol=1e-9, atol=1e-9)
