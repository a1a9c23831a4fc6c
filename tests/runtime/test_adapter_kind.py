"""The adapter kinds (runtime/adapter_kind.py): each kind's answers, and the kind a config names (`adapter: qlora` and
`adapter: lora` with `load_in_4bit: true` are one kind)."""

from __future__ import annotations

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.runtime.adapter_kind import FULL, LORA, QLORA, adapter_kind
from hybridtune.runtime.distributed import choose_engine


@pytest.mark.parametrize(
    "keys, kind",
    [
        ({}, FULL),
        ({"adapter": "full"}, FULL),
        ({"adapter": "lora"}, LORA),
        ({"adapter": "qlora"}, QLORA),
        ({"adapter": "lora", "load_in_4bit": True}, QLORA),
    ],
)
def test_a_config_names_its_kind(keys, kind):
    assert adapter_kind(load_config(None, keys)) is kind


@pytest.mark.parametrize(
    "kind, name, adapter, lora, nf4_base, engine",
    [
        (FULL, "full", "full", False, False, "fsdp"),
        (LORA, "lora", "lora", True, False, "ddp"),
        (QLORA, "qlora", "lora", True, True, "ddp"),
    ],
)
def test_each_kinds_facts(kind, name, adapter, lora, nf4_base, engine):
    """The name a user writes, the config value hybridtune.json records, the frozen base and its NF4, the engine of
    `distributed: auto`, and a checkpoint holding the adapter alone exactly when the base is frozen."""
    assert (kind.name, kind.adapter, kind.lora, kind.nf4_base) == (name, adapter, lora, nf4_base)
    assert kind.default_engine == engine
    assert choose_engine("auto", kind) == engine
    assert choose_engine("fsdp", kind) == "fsdp" and choose_engine("ddp", kind) == "ddp"
    assert kind.trainable_only is lora


@pytest.mark.parametrize("kind, under_bf16", [(FULL, torch.float32), (LORA, torch.bfloat16), (QLORA, torch.bfloat16)])
def test_the_dtype_each_kind_loads_in(kind, under_bf16):
    """A frozen base in bf16 when bf16 computes; a full fine-tune's fp32 masters whatever; fp32 without bf16."""
    assert kind.held_dtype(True) == under_bf16
    assert kind.held_dtype(False) == torch.float32


def test_fp32_masters_are_a_full_fine_tunes_under_bf16_adamw_outside_fsdp2():
    for engine in (None, "ddp"):
        assert FULL.uses_masters("adamw", True, engine)
    assert not FULL.uses_masters("adamw", True, "fsdp")  # fp32 shards under bf16 autocast
    assert not FULL.uses_masters("adamw", False, None)  # fp32 weights: nothing to keep apart
    assert not FULL.uses_masters("adamw_8bit", True, None)
    for kind in (LORA, QLORA):  # the adapters are fp32 themselves
        assert not any(kind.uses_masters("adamw", True, e) for e in (None, "ddp", "fsdp"))
