"""An MoE model with a router loss (transformers' `output_router_logits`): the trainer compiles it per class
(the one-graph loop cannot record the routers' logits) and never fills its batches with filler documents (their
tokens would count in the load-balancing loss)."""

from __future__ import annotations

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.models.anatomy import router_loss
from hybridtune.train.choices import Facts, choose_compile, choose_pack_layout


def _facts(device: str, model) -> Facts:
    return Facts(device=device, bf16_supported=True, router_loss=router_loss(model), packs=((40, 23), (61,)))


def _compile(device: str, model, **cfg) -> tuple[str, str]:
    choice, _ = choose_compile(load_config(None, cfg), _facts(device, model))
    return choice.value, choice.reason


@pytest.fixture
def moe():
    from transformers import AutoModelForCausalLM

    from hybridtune.models.presets import preset_config

    cfg = preset_config("tiny-qwen3_next", vocab_size=256)
    cfg.output_router_logits = True
    return AutoModelForCausalLM.from_config(cfg)


def test_router_loss_compiles_per_class_and_refuses_the_loop(moe):
    value, reason = _compile("cuda", moe)
    assert value == "modules" and "router loss" in reason
    assert _compile("cpu", moe)[0] == "off"
    with pytest.raises(ConfigError, match="compile 'loop': the model adds a router loss"):
        _compile("cuda", moe, compile="loop")
    moe.config.output_router_logits = False
    assert _compile("cuda", moe)[0] == "loop"


def test_router_loss_refuses_a_static_layout(moe):
    with pytest.raises(ConfigError, match="filler documents' tokens would count in its load-balancing loss"):
        choose_pack_layout(load_config(None, {"pack_layout": "static"}), _facts("cpu", moe), "modules")
    auto = choose_pack_layout(load_config(None, {}), _facts("cpu", moe), "modules")
    assert auto.value is None and "router loss" in auto.reason  # auto: dynamic, and says why
    moe.config.output_router_logits = False
    assert choose_pack_layout(load_config(None, {}), _facts("cpu", moe), "modules").value is not None


def test_router_loss_model_compiled_per_class_keeps_its_router_term(moe):
    """What `compile: auto` picks for such a model on a GPU (`modules`; the eager backend here) gives the eager
    loss with the router term in it (each MoE block's graph breaks at transformers' capture hook)."""
    from hybridtune.compiler.strategies import compile_model
    from hybridtune.data import PackedCollator
    from hybridtune.data.packing import Example
    from hybridtune.models.patching import patch_model
    from hybridtune.train.step import forward_loss

    torch._dynamo.reset()
    moe = moe.float().train()
    patch_model(moe)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10**6, ()).item()))
    batch = PackedCollator()(
        [Example(torch.randint(5, 200, (n,), generator=gen).tolist(), [1] * n) for n in (40, 23, 61)]
    )
    want = forward_loss(moe, batch, 124, False).detach()
    moe.config.output_router_logits = False
    without = forward_loss(moe, batch, 124, False).detach()
    moe.config.output_router_logits = True
    assert abs(float(without - want)) > 1e-6  # the router term is there to lose
    compile_model(moe, "modules", backend="eager")
    got = forward_loss(moe, batch, 124, False).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
