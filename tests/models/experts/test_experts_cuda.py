"""The grouped experts on a GPU: `F.grouped_mm` in bf16 (the path training takes) against a float64 CPU reference,
at a small and at the real Qwen3.5-35B-A3B expert width; the grouped LoRA; inductor with 0 breaks and one graph over
routings."""

from __future__ import annotations

import copy

import pytest
import torch
from expert_models import H, lora_model, make_block
from torch._dynamo.utils import counters

from hybridtune.models import experts as X

pytestmark = pytest.mark.cuda


def _fb(module, x, up, fn=None):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = (fn if fn is not None else module)(x)
    (y * up).sum().backward()
    g = {n: p.grad.double().cpu() for n, p in module.named_parameters() if p.grad is not None}
    return y.detach().double().cpu(), g | {"x": x.grad.double().cpu()}


def _close(got: dict, want: dict, rel: float) -> None:
    assert got.keys() == want.keys()
    for k in want:
        s = float(want[k].abs().max())
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=rel * s, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("hidden,inter,tokens", [(H, 8, 37), (2048, 512, 1001)])
def test_cuda_bf16_grouped_block_against_float64(hidden, inter, tokens):
    ref = make_block(seed=tokens, hidden=hidden, inter=inter)
    ours = copy.deepcopy(ref).to("cuda", torch.bfloat16)
    X.route_experts(ours)
    assert X._fast(torch.empty(1, hidden, device="cuda", dtype=torch.bfloat16), ours.experts.down_proj.mT)
    x = torch.randn(1, tokens, hidden, dtype=torch.float64)
    up = torch.randn_like(x)
    y0, g0 = _fb(ref, x, up)
    y1, g1 = _fb(ours, x.to("cuda", torch.bfloat16), up.to("cuda", torch.bfloat16))
    g0["y"], g1["y"] = y0, y1
    _close(g1, g0, 0.05)


def test_cuda_autocast_fp32_masters():
    """A full fine-tune's fp32 weights under bf16 autocast: the grouped GEMMs run in bf16, gradients land in fp32."""
    ref = make_block(seed=2)
    ours = copy.deepcopy(ref).to("cuda", torch.float32)
    X.route_experts(ours)
    x = torch.randn(1, 29, H, dtype=torch.float64)
    up = torch.randn_like(x)
    y0, g0 = _fb(ref, x, up)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y1, g1 = _fb(ours, x.to("cuda", torch.float32), up.to("cuda", torch.float32))
    assert ours.experts.gate_up_proj.grad.dtype == torch.float32
    g0["y"], g1["y"] = y0, y1
    _close(g1, g0, 0.05)


def test_cuda_grouped_lora_against_float64():
    ref = lora_model(r=4).base_model.model.model.layers[0].mlp
    ours = lora_model(torch.bfloat16, r=4, routed=True).base_model.model.model.layers[0].mlp.to("cuda")
    x = torch.randn(1, 23, 16, dtype=torch.float64)
    up = torch.randn_like(x)
    y0, g0 = _fb(ref, x, up)
    y1, g1 = _fb(ours, x.to("cuda", torch.bfloat16), up.to("cuda", torch.bfloat16))
    assert any("experts" in k and "lora_A" in k for k in g1)
    g0["y"], g1["y"] = y0, y1
    _close(g1, g0, 0.08)  # bf16 routing weights: a near-tie may pick another expert for a token


def test_cuda_inductor_one_graph_over_routings():
    torch._dynamo.reset()
    counters.clear()
    block = make_block(seed=9, hidden=256, inter=128).to("cuda", torch.bfloat16)
    X.route_experts(block)
    eager = copy.deepcopy(block)
    compiled = torch.compile(block, fullgraph=True)
    for seed in range(4):
        torch.manual_seed(seed)
        x = torch.randn(1, 257, 256, device="cuda", dtype=torch.bfloat16)
        up = torch.randn_like(x)
        y0, g0 = _fb(eager, x, up)
        y1, g1 = _fb(block, x, up, compiled)
        g0["y"], g1["y"] = y0, y1
        _close(g1, g0, 0.05)
    assert sum(counters["graph_break"].values()) == 0
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
