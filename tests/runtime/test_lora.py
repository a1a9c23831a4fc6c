"""What LoRA really targets is logged as peft applied it; a name peft moved onto expert weights is said."""

from __future__ import annotations

import logging

from hybridtune.config import DEFAULT_LORA_TARGETS
from hybridtune.models.loading import load_model
from hybridtune.runtime.lora import applied_targets, apply_lora


def test_dense_model_targets_as_asked(caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune.runtime.lora"):
        model = apply_lora(load_model("tiny-qwen3_5").model, 4, 8, 0.0, DEFAULT_LORA_TARGETS)
    modules, params = applied_targets(model)
    assert set(modules) == set(DEFAULT_LORA_TARGETS) and params == []
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and r.name == "hybridtune.runtime.lora"]


def test_moe_expert_rewrite_is_said(caplog):
    with caplog.at_level(logging.INFO, logger="hybridtune.runtime.lora"):
        model = apply_lora(load_model("tiny-qwen3_next").model, 4, 8, 0.0, DEFAULT_LORA_TARGETS)
    modules, params = applied_targets(model)
    moved = {"gate_proj", "up_proj", "down_proj"} - set(modules)
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "hybridtune.runtime.lora"
    ]
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


def test_vision_layers_are_never_adapted(tmp_path):
    """target_modules is a regex over the text model: a name only the vision tower has matches nothing there."""
    import pytest
    import torch

    from checkpoints import make_checkpoint
    from hybridtune.errors import ConfigError

    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl", torch.float32)
    model = load_model(str(ckpt)).model
    vision = {n.rsplit(".", 1)[-1] for n, m in model.model.visual.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "linear_fc1" in vision  # the vision MLP's name
    with pytest.raises(ConfigError, match="names a Linear layer of this model"):
        apply_lora(model, 4, 8, 0.0, ["linear_fc1"])
    peft_model = apply_lora(model, 4, 8, 0.0, ["linear_fc1", *DEFAULT_LORA_TARGETS])
    adapted = peft_model.base_model.targeted_module_names
    assert adapted and all(n.startswith("model.language_model.layers.") for n in adapted)
    assert peft_model.peft_config["default"].target_modules.startswith(r"model\.language_model\.")


def test_expert_parameters_are_validated_and_counted(caplog):
    import pytest

    from hybridtune.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"'lora_target_parameters' entry 'gate_proj_x' names no parameter.*gate_up_proj"
    ):
        apply_lora(load_model("tiny-qwen3_next").model, 4, 8, 0.0, ["q_proj"], ["gate_proj_x"])
    with pytest.raises(ConfigError, match="it has no 3-D expert weights"):
        apply_lora(load_model("tiny-qwen3_5").model, 4, 8, 0.0, ["q_proj"], ["gate_up_proj"])
    with caplog.at_level(logging.INFO, logger="hybridtune.runtime.lora"):
        model = apply_lora(load_model("tiny-qwen3_next").model, 4, 8, 0.0, ["q_proj"], ["gate_up_proj", "down_proj"])
    modules, params = applied_targets(model)
    assert modules == ["q_proj"] and params == ["down_proj", "gate_up_proj"]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    experts = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and ".experts." in n)
    assert experts > 0
    line = [r.getMessage() for r in caplog.records if "LoRA r=4" in r.getMessage()][0]
    assert f"{trainable:,} trainable" in line and "gate_up_proj (expert parameter)" in line
    # peft's LoRA on parameters has no dropout: one line, at config time and where peft maps names itself.
    with pytest.raises(ConfigError, match="set lora_dropout: 0"):
        apply_lora(load_model("tiny-qwen3_next").model, 4, 8, 0.1, DEFAULT_LORA_TARGETS)


def test_config_key_lora_target_parameters():
    import pytest

    from hybridtune.config import load_config
    from hybridtune.errors import ConfigError

    assert load_config(None, {}).lora_target_parameters == []
    cfg = load_config(None, {"adapter": "lora", "lora_target_parameters": ["gate_up_proj"], "lora_target_modules": []})
    assert cfg.lora_target_parameters == ["gate_up_proj"]
    with pytest.raises(ConfigError, match=r"'lora_dropout' = 0.1 with lora_target_parameters.*set lora_dropout: 0"):
        load_config(None, {"adapter": "lora", "lora_target_parameters": ["gate_up_proj"], "lora_dropout": 0.1})
