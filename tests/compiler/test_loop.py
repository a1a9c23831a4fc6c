"""Compile strategy "loop" under LoRA + gradient checkpointing + training: compiled == eager (loss and every
LoRA gradient), zero graph breaks, and one graph across 5 pack layouts (no recompile as the number and
lengths of documents change). On the CPU, dynamo's eager backend checks the capture in seconds (fast tier), and
the aot_eager backend (slow tier) traces the forward and the backward graph through AOT autograd as inductor
does, without inductor's C++ build time; CUDA uses inductor."""

from __future__ import annotations

import pytest
import torch
from loop_models import assert_close_step, loop_model, packed_batch, train_step

from hybridtune.models.presets import preset_config

LAYOUTS = [[10, 30, 35], [64, 11], [5, 5, 5, 5, 90], [130], [33, 1, 19, 60]]


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "eager"),  # dynamo's capture (one graph, no break, no recompile) in seconds
        pytest.param("cpu", "aot_eager", marks=pytest.mark.slow),  # + AOT autograd's backward trace
        pytest.param("cuda", "inductor", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_next"])
def test_loop_equals_eager_one_graph_across_layouts(name, device, backend):
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    model = loop_model(preset_config(name, vocab_size=256), device, lora=True, ckpt=True)
    batches = [packed_batch(lens, device, i) for i, lens in enumerate(LAYOUTS)]
    eager = [train_step(model, b) for b in batches]
    handle = compile_loop(model, backend=backend)
    counters.clear()
    for b, want in zip(batches, eager):
        assert_close_step(train_step(model, b), want, device)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1  # one graph for all 5 layouts: no recompile
    assert handle.calls == len(LAYOUTS) and handle.eager_calls == 0


def test_loop_keeps_generation_on_the_upstream_path():
    from transformers import AutoModelForCausalLM

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).eval()
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=4, do_sample=False)
        handle = compile_loop(model, backend="eager")
        got = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(want, got)
    assert handle.eager_calls > 0 and handle.calls == 0
    assert handle.undo()


def test_loop_traces_capture_hooks_left_by_an_earlier_call():
    """One call with output_hidden_states installs transformers' output-capturing hooks for good; the loop must
    still compile in one graph afterwards (the hooks traced as idle), equal to eager, and such calls still return
    their hidden states."""
    from transformers import AutoModelForCausalLM

    from hybridtune.compiler.loop import compile_loop
    from hybridtune.models.patching import patch_model

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).train()
    patch_model(model)
    batch = packed_batch([40, 23, 61], "cpu", seed=torch.randint(0, 10**6, ()).item())
    hidden = model(**batch, output_hidden_states=True).hidden_states
    assert len(hidden) == model.config.num_hidden_layers + 1
    assert model.model._output_capturing_hooks_installed
    loss_e, grads_e = train_step(model, batch)
    handle = compile_loop(model, backend="eager")
    for _ in range(2):
        loss_c, grads_c = train_step(model, batch)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
        for n in grads_e:
            torch.testing.assert_close(grads_c[n], grads_e[n], rtol=1e-6, atol=1e-7, msg=n)
    assert handle.calls == 2 and handle.eager_calls == 0
    again = model(**batch, output_hidden_states=True).hidden_states  # upstream, collecting as before
    assert len(again) == len(hidden) and torch.allclose(again[-1], hidden[-1], atol=1e-6)


def test_capture_hooks_without_a_traceable_variable_run_upstream_with_a_warning(monkeypatch, caplog):
    """Where transformers' capture variable is not the compile-aware kind (another version), a model with the
    hooks on runs upstream, says so once, and computes the same loss."""
    import logging
    from contextvars import ContextVar

    from transformers import AutoModelForCausalLM
    from transformers.utils import output_capturing

    from hybridtune.compiler.loop import compile_loop
    from hybridtune.models.patching import patch_model

    class PlainVar:  # a ContextVar with nothing for dynamo
        def __init__(self):
            self.var = ContextVar("collector", default=None)

        def get(self):
            return self.var.get()

        def set(self, value):
            return self.var.set(value)

        def reset(self, token):
            self.var.reset(token)

    monkeypatch.setattr(output_capturing, "_active_collector", PlainVar())
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).train()
    patch_model(model)
    batch = packed_batch([40, 23, 61], "cpu", seed=torch.randint(0, 10**6, ()).item())
    model(**batch, output_hidden_states=True)  # installs the hooks
    loss_e, _ = train_step(model, batch)
    handle = compile_loop(model, backend="eager")
    with caplog.at_level(logging.WARNING, logger="hybridtune.compiler.loop"):
        for _ in range(2):
            loss_c, _ = train_step(model, batch)
            torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-7)
    assert handle.calls == 0 and handle.eager_calls == 2
    assert len([r for r in caplog.records if "output-capturing hooks" in r.getMessage()]) == 1


def _collated(lens, seed, collate, device):
    from hybridtune.data.packing import Example

    gen = torch.Generator().manual_seed(seed)
    docs = [Example(torch.randint(1, 256, (n,), generator=gen).tolist(), [1] * n) for n in lens]
    b = collate(docs)
    keys = ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "gdn_chunk_indices")
    return {k: b[k].to(device) for k in keys}


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "eager"),  # dynamo's capture (one graph, no break, no recompile) in seconds
        pytest.param("cpu", "aot_eager", marks=pytest.mark.slow),  # + AOT autograd's backward trace
        pytest.param("cuda", "inductor", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_next"])
def test_static_layout_loop_equals_dynamic_eager_one_static_graph(name, device, backend):
    """Filler documents change nothing (loss and every LoRA gradient equal the unpadded batch's), and the
    static-shape loop is one graph for all 5 layouts, equal to eager."""
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop
    from hybridtune.data.collator import PackedCollator, StaticLayout

    torch._dynamo.reset()
    model = loop_model(preset_config(name, vocab_size=256), device, lora=True, ckpt=True)
    static = PackedCollator(layout=StaticLayout.fit(LAYOUTS, max_filler=1.0))
    plain = [train_step(model, _collated(lens, i, PackedCollator(), device)) for i, lens in enumerate(LAYOUTS)]
    padded = [_collated(lens, i, static, device) for i, lens in enumerate(LAYOUTS)]
    assert len({b["input_ids"].shape for b in padded}) == 1
    assert len({b["gdn_chunk_indices"].shape for b in padded}) > 1  # the chunk count varies: one graph still
    eager = [train_step(model, b) for b in padded]
    for got, want in zip(eager, plain):
        assert_close_step(got, want, device)
    compile_loop(model, backend=backend, static_shapes=True)
    counters.clear()
    for b, want in zip(padded, eager):
        assert_close_step(train_step(model, b), want, device)
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.parametrize(
    "device,backend",
    [
        ("cpu", "eager"),  # dynamo's capture (one graph, no break, no recompile) in seconds
        pytest.param("cpu", "aot_eager", marks=pytest.mark.slow),  # + AOT autograd's backward trace
        pytest.param("cuda", "inductor", marks=pytest.mark.cuda),
    ],
)
@pytest.mark.parametrize("conv", ["traced", "stacked", "op"])
def test_conv_in_graph_traced_or_as_the_op(conv, device, backend):
    """`conv_in_graph`: the GDN conv inside the compiled loop is tensor code (the reference's, or its stacked
    form: no conv op in the graph) or the opaque op (in the graph); either way compiled == eager, one graph."""
    from torch._dynamo.backends.registry import lookup_backend
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop
    from hybridtune.mixers.gdn.ops import conv_in_graph

    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    before = conv_in_graph()
    torch._dynamo.reset()
    try:
        conv_in_graph(conv)
        model = loop_model(preset_config("tiny-qwen3_5", vocab_size=256), device, lora=True, ckpt=True)
        batches = [packed_batch(lens, device, i) for i, lens in enumerate(LAYOUTS[:3])]
        eager = [train_step(model, b) for b in batches]
        compile_loop(model, backend=recording, regional=backend != "eager")  # regions need AOT autograd
        counters.clear()
        for b, want in zip(batches, eager):
            assert_close_step(train_step(model, b), want, device)
    finally:
        conv_in_graph(before)
    assert dict(counters["graph_break"]) == {} and len(graphs) == 1
    # checkpointed layers are higher-order-op subgraphs: look through every graph module
    subs = [m for m in graphs[0].modules() if isinstance(m, torch.fx.GraphModule)]
    ops = {str(n.target).removesuffix(".default") for m in subs for n in m.graph.nodes if n.op == "call_function"}
    assert "hybridtune.gdn_chunk" in ops, sorted(ops)
    assert ("hybridtune.causal_conv1d" in ops) == (conv == "op"), sorted(o for o in ops if "hybridtune" in o)
    with pytest.raises(ValueError, match="must be one of 'traced', 'stacked', 'op'"):
        conv_in_graph("fused")
