"""An MoE model with a router loss (transformers' `output_router_logits`): the trainer compiles it per class
(the one-graph loop cannot record the routers' logits) and never fills its batches with filler documents (their
tokens would count in the load-balancing loss)."""

from __future__ import annotations

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.train import distributed
from hybridtune.train.loop import Trainer


def _trainer(device: str, **cfg) -> Trainer:
    t = Trainer.__new__(Trainer)  # only what _strategy and _collator read
    t.cfg = load_config(None, cfg)
    t.dist = distributed.ONE
    t.device = torch.device(device)
    t.use_bf16 = True
    return t


@pytest.fixture
def moe():
    from transformers import AutoModelForCausalLM

    from hybridtune.models.presets import preset_config

    cfg = preset_config("tiny-qwen3_next", vocab_size=256)
    cfg.output_router_logits = True
    return AutoModelForCausalLM.from_config(cfg)


def test_router_loss_compiles_per_class_and_refuses_the_loop(moe, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="hybridtune.train.loop"):
        assert _trainer("cuda")._strategy(moe) == "modules"
    assert any("router loss" in r.getMessage() for r in caplog.records)
    assert _trainer("cpu")._strategy(moe) == "off"
    with pytest.raises(ConfigError, match="compile 'loop': the model adds a router loss"):
        _trainer("cuda", compile="loop")._strategy(moe)
    moe.config.output_router_logits = False
    assert _trainer("cuda")._strategy(moe) == "loop"


def test_router_loss_refuses_a_static_layout(moe):
    with pytest.raises(ConfigError, match="filler documents' tokens would count in its load-balancing loss"):
        _trainer("cpu", pack_layout="static")._collator("modules", moe)
    assert _trainer("cpu")._collator("modules", moe).layout is None  # auto: dynamic


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
