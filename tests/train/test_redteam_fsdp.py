"""Red-team checks of LoRA on a base built on the meta device (FSDP2) and of the FSDP2 memory estimate."""

from __future__ import annotations

import torch

from hybridtune.config import load_config
from hybridtune.models.loading import resolve_source, tokenizer_for
from hybridtune.runtime import distributed
from hybridtune.runtime.choices import state_bytes
from hybridtune.runtime.memory import ShardedModel
from hybridtune.runtime.model import build_model


def test_a_meta_built_lora_counts_nothing_resident_on_the_gpu():
    """Under FSDP2 a LoRA run's base is on the meta device and its adapter, drawn by peft, on the host: the fill
    after `fully_shard` writes both anew as shards on the GPU, so none of it is already allocated there (the
    adapter is not to be taken off the estimate of what FSDP2 holds)."""
    cfg = load_config(None, {"base_model": "tiny-qwen3_5", "adapter": "lora", "lora_r": 4})
    source = resolve_source(cfg.base_model)
    fsdp = distributed.Dist(rank=0, world=2, engine="fsdp")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, source, tokenizer_for(source), torch.device("cpu"), True, fsdp).model
    assert any(p.is_meta for p in model.parameters()) and any(not p.is_meta for p in model.parameters())
    assert ShardedModel.of(model, 2, True).resident == 0
    assert state_bytes(model, fsdp, True) == distributed.whole_model_bytes(model, 2, True)


def test_adapters_on_host_leaves_other_moves_as_to_makes_them():
    """`lora.AdaptersOnHost` keeps a move onto the meta device on the host (the dtype cast alone); every other
    `Tensor.to` call, `copy=True` among them, does what it does outside the mode."""
    from hybridtune.runtime.lora import AdaptersOnHost

    t = torch.randn(3)
    with AdaptersOnHost():
        to_cpu = t.to("cpu", copy=True)
        to_meta = t.to("meta", copy=True)
        cast = t.to(torch.device("meta"), torch.bfloat16, non_blocking=True)
        kept = t.to("meta")
    assert to_cpu is not t and torch.equal(to_cpu, t)
    assert to_meta is not t and to_meta.device.type == "cpu" and torch.equal(to_meta, t)
    assert cast.device.type == "cpu" and cast.dtype == torch.bfloat16 and torch.equal(cast, t.bfloat16())
    assert kept.device.type == "cpu" and torch.equal(kept, t)
