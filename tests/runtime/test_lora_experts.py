"""apply_lora on an MoE model: experts hybridtune routed get the grouped LoRA forward (and the same gradients as
peft's), experts left to transformers keep peft's forward."""

from __future__ import annotations

import logging

import torch

from hybridtune.models import experts
from hybridtune.models.loading import load_model
from hybridtune.runtime.lora import applied_targets, apply_lora

PARAMS = ["gate_up_proj", "down_proj"]


def _model(routed: bool):
    model = load_model("tiny-qwen3_5_moe@layers=2").model.float()
    if routed:
        experts.route_experts(model)
    torch.manual_seed(1)
    return model


def test_routed_experts_get_grouped_lora(caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune.runtime.lora"):
        model = apply_lora(_model(True), 8, 16, 0.0, ["q_proj"], PARAMS)
    assert sorted(applied_targets(model)[1]) == sorted(PARAMS)
    assert [r for r in caplog.records if "grouped GEMMs in 2 layer(s)" in r.getMessage()]
    assert experts.unroute_lora(model) == 2


def test_unrouted_experts_keep_peft():
    model = apply_lora(_model(False), 8, 16, 0.0, ["q_proj"], PARAMS)
    assert experts.unroute_lora(model) == 0


def test_grouped_and_peft_gradients_agree():
    """Same weights, same adapter init (seeded): the loss and every LoRA gradient of the routed model equal
    peft's over transformers' experts (float32: the exact fallback GEMM)."""
    ids = torch.randint(0, 100, (1, 21))
    out = []
    for routed in (False, True):
        model = apply_lora(_model(routed), 8, 16, 0.0, ["q_proj"], PARAMS)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    torch.manual_seed(len(n))
                    p.normal_(0, 0.05)  # peft starts B at zero; a trained adapter is not
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        out.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (l0, g0), (l1, g1) = out
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and any(".experts." in k for k in g0)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
