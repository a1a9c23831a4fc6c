"""LoRA on the routed experts in grouped form (models/experts.route_lora) against stock peft (its ParamWrapper
forward over transformers' eager experts loop): logits and every gradient, the adapter saved and loaded by stock
peft, merge_and_unload, disabled adapters."""

from __future__ import annotations

import pytest
import torch
from expert_models import VOCAB, E, base_model, lora_model
from peft import PeftModel
from peft.tuners.lora.layer import ParamWrapper

from hybridtune.models import experts as X


def forward_backward(model, ids, up):
    model.zero_grad(set_to_none=True)
    emb = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=emb).logits
    (logits * up).sum().backward()
    g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    g["inputs_embeds"] = emb.grad.clone()
    return logits.detach(), g


@pytest.mark.parametrize("tokens", [7, 23])
def test_grouped_lora_equals_peft_float64(tokens, monkeypatch):
    ref = lora_model()
    ours = lora_model(routed=True)
    ids = torch.randint(0, VOCAB, (1, tokens))
    up = torch.randn(1, tokens, VOCAB, dtype=torch.float64)
    y0, g0 = forward_backward(ref, ids, up)
    with monkeypatch.context() as m:
        m.setattr(ParamWrapper, "get_delta_factors", lambda *a: (_ for _ in ()).throw(AssertionError("peft ran")))
        m.setattr(ParamWrapper, "get_delta_weight", lambda *a: (_ for _ in ()).throw(AssertionError("peft ran")))
        y1, g1 = forward_backward(ours, ids, up)
    torch.testing.assert_close(y1, y0, rtol=1e-11, atol=1e-11)
    assert g0.keys() == g1.keys()
    expert_lora = [k for k in g0 if "experts" in k and "lora_" in k]
    assert len(expert_lora) == 8  # 2 layers x (gate_up_proj, down_proj) x (A, B)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], rtol=1e-9, atol=1e-11, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("r", [4, 8])
def test_bf16_grouped_lora_against_float64(r):
    """bf16 runs the grouped GEMMs (`F.grouped_mm`), a rank that is not a multiple of 8 padded with zeros; within
    bf16 rounding of stock peft in float64. The wrapped experts module alone, under one routing (a whole bf16
    model would route some tokens elsewhere than float64 does)."""
    ref = lora_model(r=r).base_model.model.model.layers[0].mlp.experts
    ours = lora_model(torch.bfloat16, r=r, routed=True).base_model.model.model.layers[0].mlp.experts
    t = 19
    x = torch.randn(t, 16, dtype=torch.float64)
    idx = torch.stack([torch.randperm(E)[:3] for _ in range(t)])
    idx[idx == 2] = 0  # expert 2 gets no tokens
    w = torch.rand(t, 3, dtype=torch.float64)
    up = torch.randn(t, 16, dtype=torch.float64)

    def fb(module, dtype):
        module.zero_grad(set_to_none=True)
        xx, ww = x.to(dtype).detach().requires_grad_(True), w.to(dtype).detach().requires_grad_(True)
        y = module(xx, idx, ww)
        (y * up.to(dtype)).sum().backward()
        g = {n: p.grad.double() for n, p in module.named_parameters() if p.grad is not None}
        return y.detach().double(), g | {"x": xx.grad.double(), "w": ww.grad.double()}

    y0, g0 = fb(ref, torch.float64)
    y1, g1 = fb(ours, torch.bfloat16)
    torch.testing.assert_close(y1, y0, rtol=0, atol=0.02 * float(y0.detach().abs().max()))
    assert g0.keys() == g1.keys() and len(g0) == 6  # x, w and the four LoRA factors
    for k in g0:
        s = float(g0[k].abs().max())
        torch.testing.assert_close(g1[k], g0[k], rtol=0, atol=0.03 * s, msg=lambda m, k=k: f"{k}: {m}")


def test_saved_adapter_loads_in_stock_peft(tmp_path):
    ours = lora_model(routed=True)
    with torch.no_grad():
        for n, p in ours.named_parameters():
            if "lora_" in n:
                p.add_(0.1 * torch.randn_like(p))  # as after training
    ids = torch.randint(0, VOCAB, (1, 11))
    want = ours(input_ids=ids).logits.detach()
    ours.save_pretrained(tmp_path)
    stock = PeftModel.from_pretrained(base_model(), str(tmp_path))
    assert stock.base_model.model.config._experts_implementation == "eager"
    torch.testing.assert_close(stock(input_ids=ids).logits, want, rtol=1e-11, atol=1e-11)


def test_merge_equals_peft_merge():
    ours = lora_model(routed=True)
    stock = lora_model()
    ids = torch.randint(0, VOCAB, (1, 9))
    before = ours(input_ids=ids).logits.detach()
    merged_ours = ours.merge_and_unload()
    merged_stock = stock.merge_and_unload()
    a, b = dict(merged_ours.named_parameters()), dict(merged_stock.named_parameters())
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert not any(isinstance(m, ParamWrapper) for m in merged_ours.modules())
    torch.testing.assert_close(merged_ours(input_ids=ids).logits, before, rtol=1e-11, atol=1e-11)


def test_disabled_adapter_falls_back_to_peft():
    ours = lora_model(routed=True)
    ids = torch.randint(0, VOCAB, (1, 9))
    base = base_model()
    X.route_experts(base)
    with ours.disable_adapter():
        torch.testing.assert_close(ours(input_ids=ids).logits, base(input_ids=ids).logits, rtol=1e-12, atol=1e-12)


def test_unrouted_experts_keep_peft_forward():
    model = lora_model()  # transformers' own experts implementation: route_lora leaves peft's forward
    assert X.route_lora(model) == {}
    assert X.unroute_lora(model) == 0
    routed = lora_model(routed=True)
    assert X.unroute_lora(routed) == 2
