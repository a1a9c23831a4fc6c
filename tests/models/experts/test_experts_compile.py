"""The grouped experts (and their grouped LoRA) under torch.compile: one graph, 0 graph breaks, no recompile as the
routing changes (same T) or as T changes (dynamic), and compiled == eager on outputs and every gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from expert_models import H, lora_model, make_block
from torch._dynamo.utils import counters

from hybridtune.models import experts as X


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def fb(module, x, up, fn=None):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    y = (fn if fn is not None else module)(x)
    (y * up).sum().backward()
    g = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return y.detach(), g | {"x": x.grad.clone()}


def check_compiled(module, inputs, backend: str, dynamic: bool, tol: float, scaled: bool = False):
    """`tol` absolute and relative; `scaled`: absolute, times each tensor's largest magnitude (inductor's fusions
    round bf16 differently from eager)."""
    eager = copy.deepcopy(module)
    compiled = torch.compile(module, backend=backend, fullgraph=True, dynamic=dynamic)
    for x in inputs:
        up = torch.randn_like(x)
        y0, g0 = fb(eager, x, up)
        y1, g1 = fb(module, x, up, compiled)
        g0["y"], g1["y"] = y0, y1
        assert g0.keys() == g1.keys()
        for k in g0:
            rtol, atol = (0.0, tol * float(g0[k].abs().max())) if scaled else (tol, tol)
            torch.testing.assert_close(g1[k], g0[k], rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1, "recompiled as the routing changed"


def routings(tokens: list[int], dtype) -> list[torch.Tensor]:
    torch.manual_seed(11)
    return [torch.randn(1, t, H, dtype=dtype) for t in tokens]


def test_routed_block_bf16_one_graph_over_routings():
    """bf16 (F.grouped_mm traced into the graph): five different routings at one T, one graph."""
    block = make_block(dtype=torch.bfloat16, seed=5)
    X.route_experts(block)
    check_compiled(block, routings([21] * 5, torch.bfloat16), "aot_eager", dynamic=False, tol=1e-2)


def test_routed_block_dynamic_tokens_one_graph():
    block = make_block(dtype=torch.bfloat16, seed=6)
    X.route_experts(block)
    check_compiled(block, routings([13, 17, 29, 40], torch.bfloat16), "aot_eager", dynamic=True, tol=1e-2)


def test_routed_block_float32_fallback_op_one_graph():
    """float32: transformers' opaque grouped-GEMM op, still one graph without breaks, equal to eager."""
    block = make_block(dtype=torch.float32, seed=7)
    X.route_experts(block)
    check_compiled(block, routings([15] * 4, torch.float32), "aot_eager", dynamic=False, tol=1e-5)


def test_grouped_lora_block_bf16_one_graph():
    """The MoE block of a peft model, experts wrapped by ParamWrappers with the grouped LoRA forward."""
    model = lora_model(torch.bfloat16, r=4, routed=True)
    block = model.base_model.model.model.layers[1].mlp
    check_compiled(block, routings([19] * 4, torch.bfloat16), "aot_eager", dynamic=False, tol=1e-2)


@pytest.mark.slow
def test_routed_block_inductor_cpu():
    """Inductor on the CPU lowers the grouped GEMMs too (slow tier: a C++ compile)."""
    block = make_block(dtype=torch.bfloat16, seed=8)
    X.route_experts(block)
    check_compiled(block, routings([21] * 3, torch.bfloat16), "inductor", dynamic=False, tol=0.1, scaled=True)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["loop", "modules"])
def test_whole_model_compiled_with_grouped_experts_and_lora(strategy):
    """hybridtune's compile strategies over a routed MoE model with LoRA on attention and experts: 0 graph breaks,
    no recompile on a second routing, loss and every LoRA gradient equal to eager."""
    from hybridtune.compiler.strategies import compile_model
    from hybridtune.models.loading import load_model
    from hybridtune.models.patching import patch_model
    from hybridtune.runtime.lora import apply_lora

    base = load_model("tiny-qwen3_5_moe").model.float()
    patch_model(base)
    X.route_experts(base)
    torch.manual_seed(1)
    model = apply_lora(base, 8, 16, 0.0, ["q_proj", "in_proj_qkv"], ["gate_up_proj", "down_proj"])
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)  # peft starts B at zero; a trained adapter is not
    eager = copy.deepcopy(model)

    def run(m, ids):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}

    compile_model(model, strategy, backend="aot_eager")
    graphs = None
    for seed in (0, 1):
        torch.manual_seed(seed)
        ids = torch.randint(0, 100, (1, 37))
        (l0, g0), (l1, g1) = run(eager, ids), run(model, ids)
        torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
        assert g0.keys() == g1.keys() and sum(".experts." in k for k in g0) == 16
        for k in g0:
            torch.testing.assert_close(g1[k], g0[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
        if graphs is None:
            graphs = counters["stats"]["unique_graphs"]
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == graphs  # the second routing reused every graph


@pytest.mark.slow
@pytest.mark.parametrize("r", [8, 4])
def test_grouped_lora_block_inductor_cpu(r):
    """Inductor lays out the LoRA factors itself; the grouped GEMMs still get layouts they take (a permuted lora_B
    copy was handed over as a strided view: "Invalid strides/sizes"), a padded rank too."""
    model = lora_model(torch.bfloat16, r=r, routed=True)
    block = model.base_model.model.model.layers[1].mlp
    check_compiled(block, routings([19] * 3, torch.bfloat16), "inductor", dynamic=False, tol=0.1, scaled=True)
