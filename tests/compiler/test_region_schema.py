"""compiler/region_schema.py: torch's per-call input-mutation check on `invoke_subgraph` memoised per compile, so that
AOT autograd traces each region body once per distinct body and operand layout instead of once per layer.

The slow-tier case compiles the regional loop (aot_eager, LoRA, checkpointing) at two depths (8 and 12 layers), with torch's own
`gen_schema` and with the memo, counting the body re-traces (`materialize_as_graph`): torch's own grows with depth,
the memo's does not, and the memo's loss and every gradient equal eager's."""

from __future__ import annotations

import importlib

import pytest
import torch
from loop_models import LAYOUTS, assert_close_step, deep_model, packed_batch, train_step

from hybridtune.compiler import region_schema

HOP = importlib.import_module("torch._higher_order_ops.invoke_subgraph").InvokeSubgraphHOP


def test_operand_key_tells_apart_what_a_schema_can_depend_on():
    a = torch.zeros(2, 3)
    key = region_schema.operand_key
    assert key(a) == key(torch.ones(2, 3))  # values do not matter
    assert key(a) != key(torch.zeros(3, 2))
    assert key(a) != key(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert key(a) != key(torch.zeros(2, 3).requires_grad_())
    assert key(a) != key(torch.zeros(3, 2).t())  # same shape, other strides
    assert key(4) == key(4) != key(5) and key(None) == key(None)
    obj = object()
    assert key(obj) == key(obj) != key(object())


def test_memoize_is_idempotent_and_undone():
    region_schema.undo()  # a fresh install, whatever an earlier test left
    try:
        first = region_schema.memoize()
        assert "memoised per compile" in first and HOP.gen_schema is not None
        wrapped = HOP.gen_schema
        assert "already" in region_schema.memoize() and HOP.gen_schema is wrapped
    finally:
        region_schema.undo()
    assert not getattr(HOP.gen_schema, "_hybridtune_memoized", False)


def test_a_body_that_mutates_its_input_is_still_refused_and_computed_once(monkeypatch):
    """torch refuses training through a region whose body writes its input (the schema's is_write): with the memo
    every call still gets that schema, traced once per compile; another body or operand layout is traced anew."""
    from torch._guards import TracingContext, tracing
    from torch._higher_order_ops import utils
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph
    from torch._subclasses.fake_tensor import FakeTensorMode

    def writes(x):
        x.add_(1)
        return (x * 2,)

    def pure(x):
        return (x * 2,)

    traced = []
    real = utils.materialize_as_graph
    monkeypatch.setattr(utils, "materialize_as_graph", lambda *a, **k: traced.append(1) or real(*a, **k))
    region_schema.undo()
    try:
        region_schema.memoize()
        with tracing(TracingContext(FakeTensorMode())):
            first = invoke_subgraph.gen_schema(writes, "subgraph_0", torch.ones(3))
            again = invoke_subgraph.gen_schema(writes, "subgraph_0", torch.ones(3))
            assert [a.is_write for a in first.arguments][-1] and again is first and len(traced) == 1
            other_layout = invoke_subgraph.gen_schema(writes, "subgraph_0", torch.ones(4))
            assert [a.is_write for a in other_layout.arguments][-1] and len(traced) == 2
            clean = invoke_subgraph.gen_schema(pure, "subgraph_1", torch.ones(3))
            assert not any(a.is_write for a in clean.arguments) and len(traced) == 3
        with tracing(TracingContext(FakeTensorMode())):  # another compile: nothing carried over
            invoke_subgraph.gen_schema(writes, "subgraph_0", torch.ones(3))
            assert len(traced) == 4
    finally:
        region_schema.undo()


def test_an_untested_torch_keeps_its_own_check(monkeypatch):
    region_schema.undo()
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    assert "not memoised (torch 2.99.0 untested" in region_schema.memoize()
    assert not getattr(HOP.gen_schema, "_hybridtune_memoized", False)


def _compile_and_count(monkeypatch, depth: int, memo: bool):
    """(body re-traces by torch's mutation check, (loss, grads) per layout compiled, the same eager)."""
    from torch._higher_order_ops import utils

    from hybridtune.compiler.loop import compile_loop

    region_schema.undo()
    calls = []
    real = utils.materialize_as_graph
    with monkeypatch.context() as m:
        m.setattr(utils, "materialize_as_graph", lambda *a, **k: calls.append(1) or real(*a, **k))
        if not memo:  # compile_loop memoises for a regional loop: here torch's own check runs
            m.setattr(region_schema, "memoize", lambda: "region schemas: off for this test")
        torch._dynamo.reset()
        model = deep_model("cpu", lora=True, ckpt=True, depth=depth)
        batches = [packed_batch(lens, "cpu", i) for i, lens in enumerate(LAYOUTS[:2])]
        eager = [train_step(model, b) for b in batches]
        compile_loop(model, backend="aot_eager", regional=True)
        got = [train_step(model, b) for b in batches]
    region_schema.undo()
    return len(calls), got, eager


@pytest.mark.slow
def test_region_bodies_are_retraced_per_distinct_body_not_per_layer(monkeypatch):
    # 8 and 12 layers: both past the depth at which every distinct body and operand layout has appeared (3 GDN then
    # 1 attention layer, repeated; the first layer's inputs differ from the others')
    own_8, _, _ = _compile_and_count(monkeypatch, 8, memo=False)
    own_12, _, _ = _compile_and_count(monkeypatch, 12, memo=False)
    memo_8, got_8, eager_8 = _compile_and_count(monkeypatch, 8, memo=True)
    memo_12, got_12, eager_12 = _compile_and_count(monkeypatch, 12, memo=True)
    assert own_12 > own_8  # torch's own check re-traces a body for every layer it stamps out
    assert memo_12 == memo_8 < own_8, (memo_8, memo_12, own_8, own_12)  # the memo: per distinct body, not per layer
    for got, want in zip(got_8 + got_12, eager_8 + eager_12):
        assert_close_step(got, want, "cpu")
