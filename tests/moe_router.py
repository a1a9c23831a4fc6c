"""The MoE models with a router loss and the packed batches that the router-loss tests share (plain builders with
arguments, so not fixtures; tests/ is on the path: `from moe_router import ...`).

- `router_model(name, coef)`: a tiny MoE preset with `output_router_logits` and router coefficient `coef`, batched
  experts, patched, fp32, train mode, seeded.
- `packed(lens, seed, layout)`: random documents of `lens` tokens packed in one row [1, T] (T padded to the static
  `layout`'s length when given).
- `loss_and_grads(model, batch, fused)`: the SFT loss and every gradient (cleared after).
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hybridtune.data import PackedCollator
from hybridtune.data.packing import Example
from hybridtune.models.patching import patch_model
from hybridtune.models.presets import preset_config
from hybridtune.train.objectives.sft import sft_loss


def router_model(name: str, coef: float = 0.5):
    torch.manual_seed(0)
    cfg = preset_config(name, vocab_size=256)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = coef  # large enough that the router term shows
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="batched_mm").float().train()
    patch_model(model)
    return model


def packed(lens, seed, layout=None):
    gen = torch.Generator().manual_seed(seed)
    docs = [Example(torch.randint(5, 200, (n,), generator=gen).tolist(), [1] * n) for n in lens]
    return PackedCollator(layout=layout)(docs)


def loss_and_grads(model, batch, fused):
    loss = sft_loss(model, batch, batch["num_loss_tokens"], fused)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads
