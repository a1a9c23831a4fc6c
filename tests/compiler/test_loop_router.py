"""An MoE model's router loss inside the one-graph loop: each layer returns its routers' logits (recorded without
transformers' ContextVar hooks), so `output_router_logits` no longer sends the forward to the eager upstream path.
compiled == transformers' eager forward: the loss with its router term, `aux_loss`, every router's logits and every
gradient; no graph break; one graph over pack layouts; with gradient checkpointing (each layer a checkpoint, and in
the slow tier a nested compile region). Fast tier: dynamo's eager backend (no regions); slow: aot_eager
(regions, AOT autograd's backward); CUDA: inductor (the default, no regions)."""

from __future__ import annotations

import logging

import pytest
import torch
from loop_models import loop_model, packed_batch

from hybridtune.models.presets import preset_config

LAYOUTS = [[40, 23, 61], [64, 11], [5, 5, 5, 5, 90]]
MODELS = ["tiny-qwen3_next", "tiny-qwen3_5_moe"]


def _moe(name, device, ckpt, lora=False):
    cfg = preset_config(name, vocab_size=256)
    cfg.output_router_logits = True
    cfg.router_aux_loss_coef = 0.5  # large enough that a wrong router term shows in the loss
    return loop_model(cfg, device, lora, ckpt)


def _step(model, batch):
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    logits = tuple(t.detach() for t in out.router_logits)
    return out.loss.detach(), out.aux_loss.detach(), logits, grads


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "eager"),
        pytest.param("cpu", "aot_eager", marks=pytest.mark.slow),
        pytest.param("cuda", "inductor", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("ckpt,lora", [(True, False), (False, True)])
@pytest.mark.parametrize("name", MODELS)
def test_router_loss_in_the_loop_equals_transformers(name, ckpt, lora, device, backend):
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    model = _moe(name, device, ckpt, lora)
    batches = [packed_batch(lens, device, int(torch.randint(0, 10**6, ()).item())) for lens in LAYOUTS]
    eager = [_step(model, b) for b in batches]
    n_moe = sum(1 for layer in model.base_model.modules() if type(layer).__name__.endswith("SparseMoeBlock"))
    assert all(len(e[2]) == n_moe > 0 for e in eager)
    # the slow tier runs the layers as nested compile regions too (regional compilation is opt-in)
    handle = compile_loop(model, backend=backend, regional=backend == "aot_eager")
    assert handle.regions.recordable
    counters.clear()
    tol = dict(rtol=1e-5, atol=1e-6) if device == "cpu" else dict(rtol=2e-3, atol=2e-4)
    for b, (loss_e, aux_e, logits_e, grads_e) in zip(batches, eager):
        loss_c, aux_c, logits_c, grads_c = _step(model, b)
        torch.testing.assert_close(aux_c, aux_e, **tol)
        torch.testing.assert_close(loss_c, loss_e, **tol)
        assert len(logits_c) == len(logits_e)
        for got, want in zip(logits_c, logits_e):
            torch.testing.assert_close(got, want, **tol)
        assert grads_c.keys() == grads_e.keys() and grads_c
        for n in grads_e:
            torch.testing.assert_close(grads_c[n], grads_e[n], **tol, msg=n)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1
    assert handle.calls == len(LAYOUTS) and handle.eager_calls == 0
    assert handle.regions.sink == []  # every recorded logit handed out


def test_router_logits_only_when_asked():
    """Without `output_router_logits` the compiled layers record nothing (the model's output has no router logits,
    the loss no router term), and asking again records again."""
    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    model = _moe("tiny-qwen3_next", "cpu", ckpt=True)
    batch = packed_batch([30, 17], "cpu", 7)
    with_term = _step(model, batch)
    model.config.output_router_logits = False
    without = model(**batch).loss.detach()
    model.config.output_router_logits = True
    assert abs(float(without - with_term[0])) > 1e-4
    compile_loop(model, backend="eager")
    out = model(**batch, output_router_logits=False)
    assert out.router_logits is None and out.aux_loss is None
    torch.testing.assert_close(out.loss.detach(), without, rtol=1e-6, atol=1e-7)
    got = _step(model, batch)
    torch.testing.assert_close(got[0], with_term[0], rtol=1e-6, atol=1e-7)
    assert len(got[2]) == len(with_term[2])


def test_unrecordable_routers_run_upstream_with_a_warning(monkeypatch, caplog):
    """Where transformers names no router class to record (another model family), a router-loss call runs the
    upstream forward, says so once, and keeps the router term."""
    from hybridtune.compiler import regions
    from hybridtune.compiler.loop import compile_loop

    monkeypatch.setattr(regions, "router_spec", lambda text: None)
    torch._dynamo.reset()
    model = _moe("tiny-qwen3_next", "cpu", ckpt=False)
    batch = packed_batch([40, 23, 61], "cpu", 3)
    want = _step(model, batch)
    handle = compile_loop(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="hybridtune.compiler.loop"):
        for _ in range(2):
            got = _step(model, batch)
            torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    warned = [r for r in caplog.records if "output_router_logits" in r.getMessage()]
    assert len(warned) == 1 and "compile: modules" in warned[0].getMessage()
    assert handle.calls == 0 and handle.eager_calls == 2


@pytest.mark.slow  # a CPU inductor compile of the tiny MoE model (about a minute)
def test_router_loss_in_the_loop_under_cpu_inductor():
    """The default backend (inductor, no regions) on the CPU: the same equalities as above, since regions under CPU
    inductor gave wrong gradients (test_loop_regions.py) and the CUDA run is the GPU's."""
    test_router_loss_in_the_loop_equals_transformers("tiny-qwen3_5_moe", False, True, "cpu", "inductor")


def test_checkpointing_switched_on_after_compiling_keeps_the_router_logits():
    """runtime/oom.py switches checkpointing on after the loop was compiled (the first step ran out of memory):
    transformers then gives every layer its own checkpoint function, around which a recording body's router logits
    could not leave ("Unsafe side effect"); the loop keeps the regions' checkpoint functions."""
    from hybridtune.compiler.loop import compile_loop
    from hybridtune.runtime.model import enable_checkpointing

    torch._dynamo.reset()
    model = _moe("tiny-qwen3_5_moe", "cpu", ckpt=False)
    batch = packed_batch(LAYOUTS[0], "cpu", 1)
    want = _step(model, batch)
    handle = compile_loop(model, backend="eager")
    enable_checkpointing(model)
    got = _step(model, batch)
    assert handle.eager_calls == 0 and handle.calls == 1
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
    assert len(got[2]) == len(want[2])
    assert got[3].keys() == want[3].keys()
    for k in want[3]:
        torch.testing.assert_close(got[3][k], want[3][k], msg=k)
    handle.undo()
