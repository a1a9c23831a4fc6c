"""The MoE presets (real Qwen3.5-35B-A3B and Qwen3-Next-80B-A3B shapes, a tiny CPU one), the `NAME@layers=N` cut,
and the FLOP count of MoE shapes by active parameters, expert LoRA included (checked against peft and the model)."""

from __future__ import annotations

import pytest
import torch

from hybridtune.errors import ModelError
from hybridtune.models.flops import parameter_counts, step_flops
from hybridtune.models.hub import resolve_source
from hybridtune.models.presets import PRESETS, preset_config


def meta_model(config):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def numel(model) -> int:
    return sum(p.numel() for p in model.parameters())


def test_qwen3_5_35b_a3b_shape():
    c = preset_config("qwen3_5-35b-a3b")
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("qwen3_5_moe_text", 2048, 40)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (256, 8, 512)
    assert c.shared_expert_intermediate_size == 512 and c.vocab_size == 248320
    assert c.layer_types.count("full_attention") == 10 and c.layer_types[3] == "full_attention"
    counts = parameter_counts(c)
    # the published figures: ~35B total, ~3B active per token
    assert 34e9 < PRESETS["qwen3_5-35b-a3b"].parameters < 36e9
    assert 2.5e9 < counts["active"] < 3.5e9


def test_qwen3_next_80b_a3b_shape():
    c = preset_config("qwen3_next-80b-a3b")
    assert (c.model_type, c.hidden_size, c.num_hidden_layers) == ("qwen3_next", 2048, 48)
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size) == (512, 10, 512)
    assert c.vocab_size == 151936 and c.layer_types.count("full_attention") == 12
    assert 79e9 < PRESETS["qwen3_next-80b-a3b"].parameters < 81e9
    assert 2.5e9 < parameter_counts(c)["active"] < 4e9


@pytest.mark.parametrize("name,n", [("qwen3_5-35b-a3b@layers=8", 8), ("qwen3_next-80b-a3b@layers=6", 6)])
def test_layer_cut_is_a_preset_with_its_own_count(name, n):
    base = name.split("@")[0]
    assert name in PRESETS and name not in list(PRESETS)  # found, not listed
    c = preset_config(name)
    full = preset_config(base)
    assert c.num_hidden_layers == n and c.layer_types == full.layer_types[:n]
    assert (c.hidden_size, c.num_experts) == (full.hidden_size, full.num_experts)
    preset = PRESETS[name]
    assert preset.name == name and preset.parameters == numel(meta_model(c))
    assert f"first {n} of {full.num_hidden_layers} layers" in preset.description
    assert resolve_source(name).is_preset


@pytest.mark.parametrize(
    "name,match",
    [
        ("qwen3_5-35b-a3b@layers=0", "from 1 to 40"),
        ("qwen3_5-35b-a3b@layers=41", "from 1 to 40"),
        ("qwen3_5-35b-a3b@layers=x", "whole number"),
        ("qwen3_5-35b-a3b@depth=3", "unknown override depth"),
        ("no-such@layers=3", "unknown preset"),
    ],
)
def test_bad_cut_is_one_line(name, match):
    with pytest.raises(ModelError, match=match) as e:
        preset_config(name)
    assert "\n" not in str(e.value)


def test_tiny_moe_preset_loads_and_runs_routed():
    from hybridtune.models import experts
    from hybridtune.models.loading import load_model

    model = load_model("tiny-qwen3_5_moe@layers=2").model
    assert model.config.num_hidden_layers == 2
    assert len(experts.route_experts(model)) == 2
    out = model(input_ids=torch.randint(0, 100, (1, 17)), use_cache=False).logits
    assert out.shape[:2] == (1, 17) and torch.isfinite(out).all()


@pytest.mark.parametrize("name", ["tiny-qwen3_5_moe", "qwen3_5-35b-a3b@layers=4", "qwen3_next-80b-a3b@layers=4"])
def test_expert_lora_flops_match_peft(name):
    """LoRA FLOPs with target_parameters: 6 per trained parameter per token for Linear targets, and for the experts
    r (in + out) per expert charged k times per token (top-k), peft's parameters scaled by k / E."""
    from peft import LoraConfig, get_peft_model

    c = preset_config(name)
    r, t = 8, 13
    cfg = LoraConfig(r=r, target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"])
    peft_model = get_peft_model(meta_model(c), cfg)
    trained = {n: p.numel() for n, p in peft_model.named_parameters() if p.requires_grad}
    experts = sum(v for n, v in trained.items() if ".experts." in n)
    linear = sum(trained.values()) - experts
    h, i = c.hidden_size, c.moe_intermediate_size
    assert experts == c.num_hidden_layers * c.num_experts * r * ((h + 2 * i) + (i + h))  # gate_up, down
    f = step_flops(c, [t], lora_r=r, lora_targets=["q_proj"], lora_parameters=["gate_up_proj", "down_proj"])
    k, e = c.num_experts_per_tok, c.num_experts
    assert f.breakdown["lora"] == 6 * t * (linear + experts * k // e)
    only_modules = step_flops(c, [t], lora_r=r, lora_targets=["q_proj"])
    assert only_modules.breakdown["lora"] == 6 * t * linear
    # checkpointing recomputes the expert adapters' forward too
    gc = step_flops(c, [t], lora_r=r, lora_parameters=["gate_up_proj"], gradient_checkpointing=True)
    no = step_flops(c, [t], lora_r=r, lora_parameters=["gate_up_proj"])
    assert gc.breakdown["recompute"] - step_flops(c, [t], gradient_checkpointing=True).breakdown["recompute"] == (
        no.breakdown["lora"] / 3
    )


def test_moe_flops_charge_active_not_stored_weights():
    c = preset_config("qwen3_5-35b-a3b@layers=4")
    counts = parameter_counts(c)
    f = step_flops(c, [100, 27])
    assert f.breakdown["linear_frozen"] == 4 * (counts["active"] - counts["lm_head"]) * 127
    assert counts["total"] - counts["active"] == 4 * (256 - 8) * 3 * 2048 * 512  # 256 experts stored, 8 active


def test_unknown_lora_parameter_is_refused():
    with pytest.raises(ValueError, match="names a weight"):
        step_flops(preset_config("tiny-qwen3_5"), [5], lora_r=4, lora_parameters=["gate_up_proj"])
