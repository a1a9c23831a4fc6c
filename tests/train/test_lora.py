"""What LoRA really targets is logged as peft applied it; a name peft moved onto expert weights is said."""

from __future__ import annotations

import logging

from hybridtune.config import DEFAULT_LORA_TARGETS
from hybridtune.models.loading import load_model
from hybridtune.train.lora import applied_targets, apply_lora


def test_dense_model_targets_as_asked(caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune.train.lora"):
        model = apply_lora(load_model("tiny-qwen3_5").model, 4, 8, 0.0, DEFAULT_LORA_TARGETS)
    modules, params = applied_targets(model)
    assert set(modules) == set(DEFAULT_LORA_TARGETS) and params == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_moe_expert_rewrite_is_said(caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune.train.lora"):
        model = apply_lora(load_model("tiny-qwen3_next").model, 4, 8, 0.0, DEFAULT_LORA_TARGETS)
    modules, params = applied_targets(model)
    moved = {"gate_proj", "up_proj", "down_proj"} - set(modules)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    if not moved:  # a peft that adapts the Linear layers themselves: nothing to say
        assert not warnings
        return
    assert params, "peft dropped MLP targets without moving them onto expert parameters"
    assert len(warnings) == 1 and "as expert parameters" in warnings[0]
    assert all(name in warnings[0] for name in moved)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "LoRA r=4" in r.getMessage()]
    assert info and "(expert parameter)" in info[0] and "gate_proj" not in info[0]


def test_rank_above_the_smallest_target_is_refused():
    import pytest
    import torch

    from hybridtune.errors import ConfigError

    model = load_model("tiny-qwen3_5").model
    largest = min(
        min(m.in_features, m.out_features)
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in DEFAULT_LORA_TARGETS
    )
    # 10**13 used to try to allocate 5 PB (an allocator traceback); largest + 1 gains nothing over full rank.
    for r in (10**13, largest + 1):
        with pytest.raises(ConfigError, match=rf"'lora_r' = {r} is larger than the largest sensible rank {largest}:"):
            apply_lora(model, r, 8, 0.0, DEFAULT_LORA_TARGETS)
    # Only the targeted layers count.
    assert apply_lora(model, largest, 8, 0.0, DEFAULT_LORA_TARGETS) is not None
