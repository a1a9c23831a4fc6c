"""Checkpoints that keep the mixers' cores (`compile_loop(keep_cores=True)`, compiler/recompute.py): the backward's
recompute runs no GDN core, the loss and every gradient equal plain checkpointing's, eagerly (the regions' bodies
outside a compile) and compiled (AOT autograd's backward graph holds no `gdn_chunk` then; plain checkpointing's
does)."""

from __future__ import annotations

import pytest
import torch
from loop_models import DEPTH, LAYOUTS, assert_close_step, deep_model, packed_batch, train_step
from torch.utils._python_dispatch import TorchDispatchMode

from hybridtune.compiler import recompute, regions
from hybridtune.models.anatomy import text_model


class _CountCores(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.hybridtune.gdn_chunk.default:
            self.calls += 1
        return func(*args, **(kwargs or {}))


def _gdn_layers(model) -> int:
    return sum(1 for k in text_model(model).config.layer_types if k == "linear_attention")


def test_policy_saves_the_cores_and_recomputes_the_rest():
    policy = recompute.keep_cores_context  # (a context pair per checkpoint call)
    fwd, recomp = policy()
    assert fwd is not None and recomp is not None
    ops = recompute.core_ops()
    assert torch.ops.hybridtune.gdn_chunk.default in ops
    assert torch.ops.aten._scaled_dot_product_flash_attention.default in ops
    # torch's varlen attention (packed CUDA batches) is recomputed until keeping it is checked on a GPU
    # torch registers its varlen attention op only once torch.nn.attention.varlen is imported (a CUDA build
    # may not have it on the CPU): where it does not exist, it cannot be kept either.
    varlen = getattr(torch.ops.torch_attn, "_varlen_attn", None)
    assert varlen is None or varlen.default not in ops
    assert torch.ops.aten.mm.default not in ops
    assert recompute.checkpoint_kwargs(False) == {"use_reentrant": False}
    assert recompute.checkpoint_kwargs(True)["context_fn"] is recompute.keep_cores_context


@pytest.mark.parametrize("lora", [True, False])
def test_eager_checkpoint_keeps_the_cores(lora):
    """Outside a compile the layers' checkpoints (regions' bodies) run the GDN core once per layer with
    `keep_cores` (twice without: forward and recompute), with the same loss and gradients over fresh layouts."""
    model = deep_model("cpu", lora=lora, ckpt=True)
    batches = [packed_batch(lens, "cpu", 10 + i) for i, lens in enumerate(LAYOUTS[:2])]
    want, plain_calls = [], []
    for b in batches:
        with _CountCores() as c:
            want.append(train_step(model, b))
        plain_calls.append(c.calls)
    regs = regions.install(text_model(model), regional=False, keep_cores=True)
    try:
        for b, w in zip(batches, want):
            with _CountCores() as c:
                got = train_step(model, b)
            assert_close_step(got, w, "cpu")
            assert c.calls == _gdn_layers(model)
    finally:
        regs.undo()
    assert plain_calls == [2 * _gdn_layers(model)] * len(batches)


def _aot_recording(graphs: dict):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(kind):
        def compiler(gm, example_inputs):
            graphs.setdefault(kind, []).append(gm)
            return make_boxed_func(gm.forward)

        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def _core_nodes(gms) -> int:
    """`gdn_chunk` calls in the graphs and every subgraph they hold (a region's body)."""
    op = torch.ops.hybridtune.gdn_chunk.default
    return sum(
        1
        for gm in gms
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if n.target is op
    )


@pytest.mark.slow
@pytest.mark.parametrize("regional", [True, False])
def test_compiled_backward_recomputes_no_core(regional):
    """Under AOT autograd the backward graph of `keep_cores` holds no GDN core (plain checkpointing's holds one per
    recomputed layer body), and the loss and every gradient equal the eager step's over several layouts."""
    from hybridtune.compiler.loop import compile_loop

    counts = {}
    for save in (False, True):
        torch._dynamo.reset()
        # inlined (regional=False), 4 layers hold every kind of layer (the first GDN layer, GDN layers after it,
        # attention) and more only lengthen the one graph's trace; regional, the deep model's 8 layers trace every
        # distinct body (from 8 layers on, twice as many as at 4-7: test_region_schema.py)
        model = deep_model("cpu", lora=True, ckpt=True, depth=DEPTH if regional else 4)
        batches = [packed_batch(lens, "cpu", 20 + i) for i, lens in enumerate(LAYOUTS[:3])]
        want = [train_step(model, b) for b in batches]
        graphs: dict = {}
        handle = compile_loop(model, backend=_aot_recording(graphs), regional=regional, keep_cores=save)
        for b, w in zip(batches, want):
            assert_close_step(train_step(model, b), w, "cpu")
        handle.undo()
        assert len(graphs["forward"]) == 1, len(graphs["forward"])  # one graph over the layouts: no recompile
        counts[save] = (_core_nodes(graphs["forward"]), _core_nodes(graphs["backward"]))
    (fwd_plain, bwd_plain), (fwd_saved, bwd_saved) = counts[False], counts[True]
    assert fwd_plain >= 1 and fwd_saved >= 1
    assert bwd_plain >= 1, counts  # plain checkpointing recomputes the core in the backward
    assert bwd_saved == 0, counts


@pytest.mark.cuda
@pytest.mark.parametrize("regional", [True, False])
def test_inductor_loop_keeping_the_cores_equals_eager(regional):
    """On the GPU (FLA's kernels, inductor with the product's settings): the loop whose checkpoints keep the cores
    gives the eager step's loss and every gradient over fresh layouts (rtol 2e-3, atol 2e-4)."""
    from loop_models import recording_backend

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    model = deep_model("cuda", lora=True, ckpt=True)
    batches = [packed_batch(lens, "cuda", 30 + i) for i, lens in enumerate(LAYOUTS)]
    want = [train_step(model, b) for b in batches]
    graphs: list = []
    compile_loop(
        model, backend=recording_backend("inductor", graphs, regional=regional), regional=regional, keep_cores=True
    )
    for b, w in zip(batches, want):
        assert_close_step(train_step(model, b), w, "cuda")
    assert len(graphs) == 1
