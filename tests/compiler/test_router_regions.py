"""The regional loop (`compile_loop(regional=True)`, train's `compile_regions`) on the MoE shapes, as the 35B-A3B
and 80B-A3B runs would use it: routed experts as grouped GEMMs with LoRA on them, LoRA on attention and GDN, the
router loss recorded out of every region, with and without gradient checkpointing. Compiled (AOT autograd, and
inductor's CPU code with the loop's settings) == eager on the loss and every gradient, over packs of odd lengths
and with a static layout's filler; one graph, no break, a region body traced once per kind of layer."""

from __future__ import annotations

import pytest
import torch
from loop_models import no_graph_caches

from hybridtune.data.collator import StaticLayout
from hybridtune.runtime.lora import apply_lora
from moe_router import loss_and_grads, packed, router_model

PACKS = [[40, 23, 61], [150], [7, 90, 3]]


def _adapted(name: str, ckpt: bool):
    model = router_model(name)
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    torch.manual_seed(1)
    model = apply_lora(model, 4, 8, 0.0, ["q_proj", "v_proj", "in_proj_qkv", "out_proj"], ["gate_up_proj", "down_proj"])
    with torch.no_grad():  # B away from zero, so that every A gets a gradient to compare too
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_b" in n.lower():
                p.normal_(0.0, 0.02)
    return model


MODELS = ["tiny-qwen3_5_moe", "tiny-qwen3_next"]
# AOT autograd with and without checkpointing; inductor's CPU build once per model (the region body is the same)
CASES = [(m, ckpt, "aot_eager") for m in MODELS for ckpt in (False, True)] + [(m, False, "inductor") for m in MODELS]


@pytest.mark.slow  # a compile per case
@pytest.mark.parametrize("name,ckpt,backend", CASES)
def test_regional_moe_loop_equals_eager(name, ckpt, backend):
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    model = _adapted(name, ckpt)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("experts" in n for n in trainable)  # LoRA sits on the routed experts too
    layout = StaticLayout.fit(PACKS, max_filler=1.0)
    batches = [packed(lens, 10 + i, layout) for i, lens in enumerate(PACKS)]
    want = [loss_and_grads(model, b, True) for b in batches]
    graphs: list = []

    def recording(gm, example_inputs):
        from torch._dynamo.backends.registry import lookup_backend

        graphs.append(gm)
        return lookup_backend(backend)(gm, example_inputs)

    with no_graph_caches():
        handle = compile_loop(
            model, backend=recording if backend == "aot_eager" else "inductor", static_shapes=True, regional=True
        )
        assert handle.regions is not None and handle.regions.regional and handle.regions.recordable
        counters.clear()
        for b, (want_loss, want_grads) in zip(batches, want):
            got_loss, got_grads = loss_and_grads(model, b, True)
            torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
            assert got_grads.keys() == want_grads.keys() and trainable <= got_grads.keys()
            for n in want_grads:
                torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    assert dict(counters["graph_break"]) == {} and handle.eager_calls == 0
    if backend == "aot_eager":
        assert len(graphs) == 1  # one graph over the three packs (the chunk count varies, nothing recompiles)
        calls = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
        bodies = {n.args[0].target for n in calls}
        # the GDN layers stamped out of one traced body (the first may be inlined, as may the one attention layer)
        assert len(calls) >= 2 and len(bodies) < len(calls)
