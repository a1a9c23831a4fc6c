"""dpo's LoRA-off reference runs the policy's own compiled code: the adapters are switched off as data (each LoRA
layer's scale a zero tensor, `runtime.lora.adapters_off`), not by peft's `disable_adapter` flag, which the compiled
loop guards on and so compiles a second graph; a compiled model runs that forward with grad mode on, as the policy's.

- eager, fp32: the reference's log-probabilities equal peft's `disable_adapter`'s, and a window of several micro-
  batches (forwards before one backward) gives the loss and every gradient of the `disable_adapter` implementation;
- the compiled loop (compile_loop as the trainer's CPU tests run it: aot_eager, regional, static layout) compiles as
  many graphs for a dpo step as for an sft step on the tiny preset (printed with both first steps' times), and its
  dpo loss and gradients equal the eager ones;
- a full fine-tune's reference (a frozen copy of the starting model) compiled as `compose` compiles it: one graph
  more than sft's, every reference forward through it, the loss and gradients of the eager run.
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from objective_grads import grads
from test_dpo_reference import build, make_pairs

from hybridtune.batch import NUM_LOSS_TOKENS
from hybridtune.compiler.loop import compile_loop
from hybridtune.data.collator import StaticLayout
from hybridtune.data.pairs import PairCollator, pack_pairs
from hybridtune.runtime import compose, lora
from hybridtune.runtime.distributed import LossModule
from hybridtune.train.objectives import preference
from hybridtune.train.objectives.sft import SFT

TOL = dict(rtol=1e-6, atol=1e-7)  # fp32, the same operations: equal but for the order of a sum


def batches_of(pairs, static: bool) -> list[dict]:
    bins = pack_pairs(pairs, 64, packing=True)
    layout = StaticLayout.fit([[len(d) for d in b] for b in bins]) if static else None
    collate = PairCollator(layout=layout)
    return [collate(b) for b in bins]


@contextlib.contextmanager
def peft_flag(monkeypatch):
    """The implementation before: peft's `disable_adapter` for the reference forward."""
    with monkeypatch.context() as m:
        m.setattr(preference, "adapters_off", lambda model: model.disable_adapter())
        yield


def window(model, obj, batches) -> torch.Tensor:
    """The objective's window: every micro-batch's forward, then one backward."""
    n = obj.window_items(batches)
    engine = LossModule(model, obj)
    total = sum(engine(b, n) for b in batches)
    total.backward()
    return total.detach()


def test_reference_as_data_equals_peft_disable_adapter(monkeypatch):
    model, obj, params, _ = build("lora", "dpo", rpo_alpha=0.4)
    layers = [m for m in model.modules() if isinstance(getattr(m, "scaling", None), dict)]
    # Tensors from the objective's build on: the first compiled forward (an eval's, say) already reads them.
    assert layers and all(isinstance(v, torch.Tensor) for m in layers for v in m.scaling.values())
    batches = batches_of(make_pairs(n=7, seed=5), static=False)
    assert len(batches) > 1
    with torch.no_grad():
        with model.disable_adapter():
            want = [preference.pair_logps(model, b, fused=True)[0] for b in batches]
        policy = [preference.pair_logps(model, b, fused=True)[0] for b in batches]
        got = [preference.reference_logps(model, None, b, fused=True)[0] for b in batches]
        after = [preference.pair_logps(model, b, fused=True)[0] for b in batches]
    for g, w, p, a in zip(got, want, policy, after):
        torch.testing.assert_close(g, w, **TOL)
        torch.testing.assert_close(a, p, rtol=0, atol=0)  # the adapters back on, exactly
        assert (p - w).abs().max() > 1e-3  # the policy is off its reference: the check can see a difference
    scales = lora.live_scales(model)
    assert scales and all(isinstance(s.owner[s.name], torch.Tensor) and s.owner[s.name] is s.on for s in scales)

    loss = window(model, obj, batches)
    got_grads = grads(params)
    with peft_flag(monkeypatch):
        want_loss = window(model, obj, batches)
    want_grads = grads(params)
    torch.testing.assert_close(loss, want_loss, **TOL)
    scale = max(float(g.abs().max()) for g in want_grads)
    assert scale > 0
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * scale)


def counting(graphs: list):
    """aot_eager (the compiled loop's CPU backend in the trainer's tests), keeping each graph dynamo compiles."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def compiled_steps(objective: str, adapter: str = "lora"):
    """(graphs compiled, first step's seconds, the next steps' seconds, the window's loss, its gradients, the
    reference's compile handle) of the tiny preset's objective under the compiled loop, a full fine-tune's reference
    compiled as `compose` compiles it."""
    torch._dynamo.reset()
    model, obj, params, _ = build(adapter, "dpo")
    if objective == "sft":
        obj = SFT()
    graphs: list = []
    opts = {"static_shapes": True, "regional": True}
    compile_loop(model, backend=counting(graphs), **opts)
    ref = compose.compile_reference(obj, "loop", opts, backend=counting(graphs))
    batches = batches_of(make_pairs(n=8, seed=9), static=True)
    n = sum(b[NUM_LOSS_TOKENS] for b in batches) if objective == "sft" else obj.window_items(batches)
    engine = LossModule(model, obj)
    start = time.perf_counter()
    total = engine(batches[0], n)
    total.backward()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for b in batches[1:]:
        loss = engine(b, n)
        loss.backward()
        total = total + loss
    rest = time.perf_counter() - start
    torch._dynamo.reset()
    return len(graphs), first, rest, total.detach(), grads(params), ref


def assert_as_eager(adapter: str, loss, got) -> None:
    """The compiled window's loss and gradients are the eager run's (fp32)."""
    model, obj, params, _ = build(adapter, "dpo")
    want = window(model, obj, batches_of(make_pairs(n=8, seed=9), static=True))
    want_grads = grads(params)
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    scale = max(float(g.abs().max()) for g in want_grads)
    for g, w in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.slow
def test_dpo_compiles_no_more_graphs_than_sft():
    sft_graphs, sft_first, sft_rest, _, _, _ = compiled_steps("sft")
    dpo_graphs, dpo_first, dpo_rest, loss, got, _ = compiled_steps("dpo")
    print(
        f"\ncompiled loop (aot_eager, regional, static layout), tiny-qwen3_5 LoRA: sft {sft_graphs} graph(s), first "
        f"step {sft_first:.1f} s, next steps {sft_rest:.2f} s; dpo {dpo_graphs} graph(s), first step "
        f"{dpo_first:.1f} s, next steps {dpo_rest:.2f} s"
    )
    assert sft_graphs == 1
    assert dpo_graphs == sft_graphs  # the reference forward runs the policy's graph, adapters off as data
    assert_as_eager("lora", loss, got)


@pytest.mark.slow
def test_full_fine_tune_reference_compiles_one_graph_beside_the_policy():
    """A full fine-tune's reference is a frozen copy of the starting model (other weights, no gradients): compiled
    as the policy is, it adds one graph (its forward without gradients), not an eager forward every step."""
    sft_graphs, sft_first, _, _, _, _ = compiled_steps("sft", "full")
    dpo_graphs, dpo_first, dpo_rest, loss, got, ref = compiled_steps("dpo", "full")
    print(
        f"\ncompiled loop, tiny-qwen3_5 full fine-tune: sft {sft_graphs} graph(s), first step {sft_first:.1f} s; dpo "
        f"{dpo_graphs} graph(s) (the reference's included), first step {dpo_first:.1f} s, next steps {dpo_rest:.2f} s"
    )
    assert (
        ref is not None and ref.calls == len(batches_of(make_pairs(n=8, seed=9), static=True)) and ref.eager_calls == 0
    )
    assert dpo_graphs == sft_graphs + 1
    assert_as_eager("full", loss, got)
