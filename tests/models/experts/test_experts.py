"""Grouped-GEMM experts (models/experts.py) against transformers' eager experts loop: outputs and every gradient,
odd token counts, experts without tokens, LoRA on the experts; in float64 through the exact fallback GEMM and in
bf16 through `F.grouped_mm` (the GPU's path) against a float64 reference."""

from __future__ import annotations

import copy

import pytest
import torch
from expert_models import E, H, K, make_block

from hybridtune.models import experts as X


def grads(module: torch.nn.Module, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    out.update({f"input{i}": t.grad.clone() for i, t in enumerate(inputs) if t.grad is not None})
    return out


def run(module, x, *extra, upstream=None):
    module.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    extra = [e.detach().clone().requires_grad_(e.is_floating_point()) for e in extra]
    y = module(x, *extra)
    upstream = torch.randn_like(y) if upstream is None else upstream
    (y * upstream).sum().backward()
    return y.detach(), grads(module, x, *extra)


def assert_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tol)


@pytest.mark.parametrize("kind", ["qwen3_5_moe", "qwen3_next"])
@pytest.mark.parametrize("tokens", [1, 13, 37])
def test_block_equals_eager_float64(kind, tokens):
    """The whole sparse MoE block (router, experts, shared expert): output and the gradients of the input, the
    router, both expert weights and the shared expert, exact to float64 rounding."""
    ref = make_block(kind, seed=tokens)
    ours = copy.deepcopy(ref)
    assert X.route_experts(ours)
    assert ours.experts.config._experts_implementation == X.NAME
    assert ref.experts.config._experts_implementation == "eager"
    x = torch.randn(1, tokens, H, dtype=torch.float64)
    up = torch.randn(1, tokens, H, dtype=torch.float64)
    y0, g0 = run(ref, x, upstream=up)
    y1, g1 = run(ours, x, upstream=up)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    assert {"gate.weight", "experts.gate_up_proj", "experts.down_proj", "input0"} <= g0.keys()
    assert_close(g1, g0, rtol=1e-10, atol=1e-12)


ROUTINGS = {
    "experts 1 and 4 empty": lambda t: torch.tensor(
        [[0, 2, 3], [5, 0, 2], [3, 5, 0]] * (t // 3) + [[2, 3, 5]] * (t % 3)
    ),
    "all tokens on experts 0..2": lambda t: torch.tensor([[0, 1, 2]] * t),
    "last expert only in one token": lambda t: torch.tensor([[0, 1, 2]] * (t - 1) + [[5, 1, 0]]),
}


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_experts_routings_with_empty_experts(routing):
    """The experts module alone under hand-made routings where some experts get no tokens (their weight gradient
    must be exactly zero), with the routing weights' gradient too."""
    ref = make_block(seed=1).experts
    ours = copy.deepcopy(ref)
    ours.config._experts_implementation = "eager"
    X.route_experts(ours)
    t = 11
    idx = ROUTINGS[routing](t)
    w = torch.rand(t, K, dtype=torch.float64)
    x = torch.randn(t, H, dtype=torch.float64)
    up = torch.randn(t, H, dtype=torch.float64)
    y0, g0 = run(ref, x, idx, w, upstream=up)
    y1, g1 = run(ours, x, idx, w, upstream=up)
    torch.testing.assert_close(y1, y0, rtol=1e-12, atol=1e-12)
    assert_close(g1, g0, rtol=1e-10, atol=1e-12)
    empty = sorted(set(range(E)) - set(idx.flatten().tolist()))
    for e in empty:
        assert torch.count_nonzero(g1["gate_up_proj"][e]) == 0 and torch.count_nonzero(g1["down_proj"][e]) == 0
    assert "input2" in g1  # the routing weights' gradient (the router's path)


def test_route_offsets():
    idx = torch.tensor([[4, 0], [0, 2], [2, 4], [5, 0]])
    perm, offs = X.route(idx, 6)
    assert offs.tolist() == [3, 3, 5, 5, 7, 8] and offs.dtype == torch.int32
    assert idx.reshape(-1)[perm].tolist() == [0, 0, 0, 2, 2, 4, 4, 5]


def test_bf16_grouped_mm_path_against_float64():
    """bf16 takes `F.grouped_mm` (the path the GPU runs) and stays within bf16 rounding of the float64 eager block;
    the fallback GEMM is not called."""
    ref = make_block(seed=3)
    ours = copy.deepcopy(ref).to(torch.bfloat16)
    X.route_experts(ours)
    x = torch.randn(1, 29, H, dtype=torch.float64)
    up = torch.randn(1, 29, H, dtype=torch.float64)
    y0, g0 = run(ref, x, upstream=up)
    fallback = torch.ops.transformers.grouped_mm_fallback
    calls = []
    torch.ops.transformers.grouped_mm_fallback = lambda *a: calls.append(1) or fallback(*a)
    try:
        y1, g1 = run(ours, x.bfloat16(), upstream=up.bfloat16())
    finally:
        torch.ops.transformers.grouped_mm_fallback = fallback
    assert not calls
    scale = y0.abs().max()
    torch.testing.assert_close(y1.double(), y0, rtol=0, atol=0.03 * float(scale))
    for k in g0:
        s = float(g0[k].abs().max())
        torch.testing.assert_close(g1[k].double(), g0[k], rtol=0, atol=0.05 * s, msg=lambda m, k=k: f"{k}: {m}")


def test_autocast_casts_fp32_weights():
    """Under autocast the fp32 weights (a full fine-tune's masters) compute in the autocast dtype, as F.linear does."""
    block = make_block(seed=4, dtype=torch.float32)
    X.route_experts(block)
    seen = []
    orig = X.grouped_mm
    X.grouped_mm = lambda a, b, offs: seen.append((a.dtype, b.dtype)) or orig(a, b, offs)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = block(torch.randn(1, 9, H))
    finally:
        X.grouped_mm = orig
    assert y.dtype == torch.float32
    assert seen and all(d == (torch.bfloat16, torch.bfloat16) for d in seen)


def test_unroute_restores():
    block = make_block()
    X.route_experts(block)
    X.route_experts(block)  # idempotent: the first implementation is what comes back
    assert X.unroute_experts(block) == 1
    assert block.experts.config._experts_implementation == "eager"


def test_non_matching_module_untouched():
    assert X.route_experts(torch.nn.Linear(4, 4)) == {}
    assert not X.is_experts(torch.nn.Linear(4, 4))


def test_gathered_mm_equals_grouped_fallback():
    """The compiled form of non-bf16 grouped GEMMs equals transformers' op (empty groups first, middle, last)."""
    torch.manual_seed(2)
    a = torch.randn(9, 5, dtype=torch.float64)
    b = torch.randn(4, 5, 3, dtype=torch.float64)
    for offs in ([0, 4, 4, 9], [3, 3, 9, 9], [9, 9, 9, 9]):
        o = torch.tensor(offs, dtype=torch.int32)
        torch.testing.assert_close(X.gathered_mm(a, b, o), torch.ops.transformers.grouped_mm_fallback(a, b, o))


def test_route_again_after_the_implementation_was_reset():
    """A config whose implementation was set back (by hand, or another tool) is routed again."""
    block = make_block()
    X.route_experts(block)
    block.experts.config._experts_implementation = "eager"
    X.route_experts(block)
    assert block.experts.config._experts_implementation == X.NAME
    X.unroute_experts(block)
    assert block.experts.config._experts_implementation == "eager"


def test_routing_leaves_no_key_in_the_saved_config():
    """Routing is not written into a saved config.json (a full fine-tune's export, a preset's base_model): the
    marker of the implementation unroute gives back was a config attribute, serialised by to_dict."""
    block = make_block()
    X.route_experts(block)
    cfg = block.experts.config
    assert not [k for k in cfg.to_dict() if "hybridtune" in k]
    assert "hybridtune" not in cfg.to_json_string()
    assert X.unroute_experts(block) == 1
    assert cfg._experts_implementation == "eager"
