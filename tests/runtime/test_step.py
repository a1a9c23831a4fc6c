"""The fused loss path equals transformers' own loss on a packed batch: value and every trained gradient."""

from __future__ import annotations

import pytest
import torch

from hybridtune.data import PackedCollator
from hybridtune.data.packing import Example
from hybridtune.runtime.step import fused_loss_blocker
from hybridtune.train.objectives.sft import sft_loss


def _batch(vocab, lens, seed):
    gen = torch.Generator().manual_seed(seed)
    docs = []
    for n in lens:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        mask = [False] * (n // 3) + [True] * (n - n // 3)  # prompt untrained, reply trained
        docs.append(Example(ids, mask))
    return PackedCollator()(docs)


@pytest.mark.parametrize("preset", ["tiny-qwen3_5", "tiny-qwen3_next"])
@pytest.mark.parametrize("lora", [False, True])
def test_fused_equals_plain(preset, lora):
    from hybridtune.models.loading import load_model
    from hybridtune.models.patching import patch_model

    model = load_model(preset, seed=3).model  # fp32 (the MoE grouped matmul has no fp64)
    patch_model(model)
    if lora:
        from hybridtune.runtime.lora import apply_lora

        model = apply_lora(model, 4, 8, 0.0, ["q_proj", "in_proj_qkv", "out_proj"])
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)  # B = 0 at init would make LoRA's gradients trivially equal
    assert fused_loss_blocker(model) is None
    batch = _batch(model.config.vocab_size, [37, 1, 90, 63], seed=5)
    n_items = batch["num_loss_tokens"] + 11  # as if another micro-batch shared the window
    grads = []
    for fused in (False, True):
        model.zero_grad(set_to_none=True)
        loss = sft_loss(model, batch, n_items, fused)
        loss.backward()
        grads.append((float(loss), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (plain, gp), (fused, gf) = grads
    assert abs(plain - fused) <= 1e-5 * abs(plain)
    assert gp.keys() == gf.keys() and len(gp) > 0
    for n in gp:
        torch.testing.assert_close(gf[n], gp[n], rtol=1e-4, atol=1e-6, msg=n)
