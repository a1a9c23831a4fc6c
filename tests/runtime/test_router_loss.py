"""An MoE model with a router loss (transformers' `output_router_logits`): its loss through `train.step`, the
router term computed as its forward computes it with a static layout's filler documents kept out of the statistics
(fused or not, eager or in the compiled loop), and the choices the trainer makes for it."""

from __future__ import annotations

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.models.anatomy import router_loss
from hybridtune.runtime.choices import Facts, choose_compile, choose_pack_layout
from moe_router import loss_and_grads, packed, router_model


def _facts(device: str, model) -> Facts:
    return Facts(device=device, bf16_supported=True, router_loss=router_loss(model), packs=((40, 23), (61,)))


def _compile(device: str, model, **cfg) -> tuple[str, str]:
    choice = choose_compile(load_config(None, cfg), _facts(device, model))
    return choice.value, choice.reason


@pytest.fixture
def moe():
    from transformers import AutoModelForCausalLM

    from hybridtune.models.presets import preset_config

    cfg = preset_config("tiny-qwen3_next", vocab_size=256)
    cfg.output_router_logits = True
    return AutoModelForCausalLM.from_config(cfg)


def test_router_loss_compiles_the_loop(moe):
    value, reason = _compile("cuda", moe)
    assert value == "loop" and "router" not in reason
    assert _compile("cpu", moe)[0] == "off"
    assert _compile("cuda", moe, compile="loop")[0] == "loop"  # no longer refused: the loop records the logits
    assert _compile("cuda", moe, compile="modules")[0] == "modules"


def test_router_loss_takes_a_static_layout(moe):
    static = choose_pack_layout(load_config(None, {"pack_layout": "static"}), _facts("cpu", moe), "loop")
    assert static.value is not None  # no longer refused: the step masks the filler out of the router loss
    auto = choose_pack_layout(load_config(None, {}), _facts("cpu", moe), "loop")
    assert auto.value is not None and "router" not in auto.reason


def test_router_loss_model_compiled_per_class_keeps_its_router_term(moe):
    """What `compile: auto` picks for such a model on a GPU (`modules`; the eager backend here) gives the eager
    loss with the router term in it (each MoE block's graph breaks at transformers' capture hook)."""
    from hybridtune.compiler.strategies import compile_model
    from hybridtune.data import PackedCollator
    from hybridtune.data.packing import Example
    from hybridtune.models.patching import patch_model
    from hybridtune.train.objectives.sft import sft_loss

    torch._dynamo.reset()
    moe = moe.float().train()
    patch_model(moe)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ()).item()))
    batch = PackedCollator()(
        [Example(torch.randint(5, 200, (n,), generator=gen).tolist(), [1] * n) for n in (40, 23, 61)]
    )
    want = sft_loss(moe, batch, 124, False).detach()
    moe.config.output_router_logits = False
    without = sft_loss(moe, batch, 124, False).detach()
    moe.config.output_router_logits = True
    assert abs(float(without - want)) > 1e-6  # the router term is there to lose
    compile_model(moe, "modules", backend="eager")
    got = sft_loss(moe, batch, 124, False).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["tiny-qwen3_next", "tiny-qwen3_5_moe"])
@pytest.mark.parametrize("fused", [False, True])
def test_filler_is_kept_out_of_the_router_loss(name, fused):
    """A static layout's filler documents change neither the loss nor any gradient: the packed batch with filler gives
    what transformers' own forward gives for the same real tokens without filler (router term included), fused or
    not; counting the filler in the router statistics (transformers' forward on the padded batch) would differ."""
    from hybridtune.data.collator import StaticLayout
    from hybridtune.runtime.step import real_token_mask

    model = router_model(name)
    lens, seed = [40, 23, 61], int(torch.randint(0, 10**6, ()).item())
    layout = StaticLayout.fit([lens, [150]], max_filler=1.0)
    plain, padded = packed(lens, seed), packed(lens, seed, layout)
    T = padded["input_ids"].shape[1]
    assert T - padded["num_tokens"] >= 20 and real_token_mask(plain) is None
    mask = real_token_mask(padded)
    assert mask.shape == (1, T) and int(mask.sum()) == sum(lens) and mask[0, : sum(lens)].all()

    want_loss, want_grads = loss_and_grads(model, plain, False)  # transformers' own forward and loss
    out = model(**{k: plain[k] for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")})
    torch.testing.assert_close(want_loss, out.loss.detach(), rtol=0, atol=0)
    got_loss, got_grads = loss_and_grads(model, padded, fused)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == want_grads.keys()
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    counted = model(**{k: padded[k] for k in ("input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")})
    assert abs(float(counted.loss.detach() - want_loss)) > 1e-5  # the filler would have counted


def test_fused_loss_keeps_the_router_term():
    """The fused loss stands in for an MoE model's own loss: cross-entropy plus the router term as its forward
    computes it (loss and every gradient equal to transformers'), so nothing blocks it for such a model."""
    from hybridtune.runtime.step import fused_loss_blocker

    model = router_model("tiny-qwen3_next")
    assert fused_loss_blocker(model) is None
    batch = packed([33, 64, 9], int(torch.randint(0, 10**6, ()).item()))
    want_loss, want_grads = loss_and_grads(model, batch, False)
    got_loss, got_grads = loss_and_grads(model, batch, True)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
    for n in want_grads:
        torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("fused", [False, True])
def test_router_loss_with_filler_in_the_compiled_loop(fused):
    """Under the one-graph loop (dynamo's eager backend here: the capture), a static layout's batches with filler give
    the eager loss and gradients, filler kept out, with no graph break and one graph."""
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop
    from hybridtune.data.collator import StaticLayout

    torch._dynamo.reset()
    model = router_model("tiny-qwen3_5_moe")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    packs = [[40, 23, 61], [150], [7, 90]]
    layout = StaticLayout.fit(packs, max_filler=1.0)
    batches = [packed(lens, i, layout) for i, lens in enumerate(packs)]
    plain = [loss_and_grads(model, packed(lens, i), False) for i, lens in enumerate(packs)]
    handle = compile_loop(model, backend="eager", static_shapes=True)
    counters.clear()
    for b, (want_loss, want_grads) in zip(batches, plain):
        got_loss, got_grads = loss_and_grads(model, b, fused)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-6)
        for n in want_grads:
            torch.testing.assert_close(got_grads[n], want_grads[n], rtol=1e-5, atol=1e-6, msg=n)
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1
    assert handle.calls == len(packs) and handle.eager_calls == 0
