"""Built-in model presets: configs with random weights, never a download.

`tiny-*` presets are small enough to train on a 2-core CPU in minutes and use the bundled tokenizer.
The real-shape presets (`qwen3_5-0.8b`, `qwen3_5-2b`, `qwen3_5-9b`, the MoE `qwen3_5-35b-a3b` and
`qwen3_next-80b-a3b`) copy the layer shapes of the published checkpoints so that benchmarks measure realistic
work; their weights are random.

`NAME@layers=N` is preset NAME cut to its first N decoder layers (same widths, same layer pattern), so that a
shape too large for one GPU can still be measured: `qwen3_next-80b-a3b@layers=12`. It is accepted wherever a
preset name is (`base_model`, `hybridtune bench --base_model`, `hybridtune doctor --model`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from hybridtune.errors import ModelError, did_you_mean
from hybridtune.models.tokenizer_files import bundled_tokenizer

# The published vocabularies; the real-shape presets keep them so the LM head costs what it costs.
QWEN3_5_VOCAB = 248320
QWEN3_NEXT_VOCAB = 151936
LAYERS_KEY = "layers"  # NAME@layers=N


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str  # transformers model_type of the config built
    description: str
    build_config: Callable[[int], Any]  # vocab_size -> transformers PretrainedConfig
    uses_bundled_tokenizer: bool  # tiny presets size their vocab to the bundled tokenizer
    parameters: int  # of the model built (tied weights once); a test builds each on the meta device and counts
    vocab_size: int = QWEN3_5_VOCAB  # of a real-shape preset (a tiny one takes the bundled tokenizer's)


def _hybrid_layer_types(n_layers: int, full_every: int = 4) -> list[str]:
    # Qwen3.5 / Qwen3-Next pattern: three linear-attention (GDN) layers, then one full attention.
    return ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(n_layers)]


def _qwen3_5_text(vocab_size: int, **kw: Any):
    from transformers import Qwen3_5TextConfig

    n = kw.pop("num_hidden_layers")
    return Qwen3_5TextConfig(
        vocab_size=vocab_size,
        num_hidden_layers=n,
        layer_types=_hybrid_layer_types(n),
        max_position_embeddings=kw.pop("max_position_embeddings", 32768),
        **kw,
    )


def _tiny_qwen3_5(vocab_size: int):
    return _qwen3_5_text(
        vocab_size,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # grouped values (HV = 2H), as in the 9B shape
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        initializer_range=0.02,
    )


def _tiny_qwen3_next(vocab_size: int):
    from transformers import Qwen3NextConfig

    n = 4
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=n,
        layer_types=_hybrid_layer_types(n),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        decoder_sparse_step=1,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def _qwen3_5_0_8b(vocab_size: int):
    return _qwen3_5_text(
        vocab_size,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=True,
    )


def _qwen3_5_2b(vocab_size: int):
    return _qwen3_5_text(
        vocab_size,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=True,
    )


def _qwen3_5_9b(vocab_size: int):
    return _qwen3_5_text(
        vocab_size,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        tie_word_embeddings=False,
    )


def _tiny_qwen3_5_moe(vocab_size: int):
    from transformers import Qwen3_5MoeTextConfig

    n = 4
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=n,
        layer_types=_hybrid_layer_types(n),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )


def _qwen3_5_35b_a3b(vocab_size: int):
    from transformers import Qwen3_5MoeTextConfig

    n = 40
    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size,
        hidden_size=2048,
        num_hidden_layers=n,
        layer_types=_hybrid_layer_types(n),
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    )


def _qwen3_next_80b_a3b(vocab_size: int):
    from transformers import Qwen3NextConfig

    n = 48
    return Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=2048,
        intermediate_size=5120,  # only read by dense layers, which this shape has none of
        num_hidden_layers=n,
        layer_types=_hybrid_layer_types(n),
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        tie_word_embeddings=False,
        max_position_embeddings=32768,
    )


# Which draw of a preset's seeded random weights this code makes: 2 = transformers' init replayed block by block
# (models/meta.py PresetReader, for the plain and the meta-device load alike); 1 = the draws transformers made while
# constructing the model. A checkpoint records it, so that LoRA trained on one draw is never resumed on another.
PRESET_DRAW = 2

PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "tiny-qwen3_5",
            "qwen3_5_text",
            "4 layers (3 GDN + 1 attention), hidden 128; CPU demo",
            _tiny_qwen3_5,
            True,
            parameters=869_560,
        ),
        Preset(
            "tiny-qwen3_next",
            "qwen3_next",
            "4 layers (3 GDN + 1 attention), 4-expert MoE; CPU tests",
            _tiny_qwen3_next,
            True,
            parameters=822_968,
        ),
        Preset(
            "qwen3_5-0.8b",
            "qwen3_5_text",
            "Qwen3.5-0.8B text shape, random weights; benchmarks",
            _qwen3_5_0_8b,
            False,
            parameters=752_393_024,
        ),
        Preset(
            "qwen3_5-2b",
            "qwen3_5_text",
            "Qwen3.5-2B text shape (18 GDN + 6 attention), random weights; benchmarks",
            _qwen3_5_2b,
            False,
            parameters=1_881_825_088,
        ),
        Preset(
            "qwen3_5-9b",
            "qwen3_5_text",
            "Qwen3.5-9B text shape (24 GDN + 8 attention, HV = 2H), random weights; benchmarks",
            _qwen3_5_9b,
            False,
            parameters=8_953_803_264,
        ),
        Preset(
            "tiny-qwen3_5_moe",
            "qwen3_5_moe_text",
            "4 layers (3 GDN + 1 attention), 8 experts top-2 + shared expert; CPU tests of the MoE path",
            _tiny_qwen3_5_moe,
            True,
            parameters=1_218_232,
        ),
        Preset(
            "qwen3_5-35b-a3b",
            "qwen3_5_moe_text",
            "Qwen3.5-35B-A3B text shape (30 GDN + 10 attention, 256 experts top-8 + shared), random weights; "
            "benchmarks (NAME@layers=N cuts it)",
            _qwen3_5_35b_a3b,
            False,
            parameters=34_660_610_688,
        ),
        Preset(
            "qwen3_next-80b-a3b",
            "qwen3_next",
            "Qwen3-Next-80B-A3B shape (36 GDN + 12 attention, 512 experts top-10 + shared), random weights; "
            "benchmarks (NAME@layers=N cuts it to one GPU)",
            _qwen3_next_80b_a3b,
            False,
            parameters=79_674_391_296,
            vocab_size=QWEN3_NEXT_VOCAB,
        ),
    ]
}


def split_name(name: str) -> tuple[str, dict[str, str]]:
    """`NAME@key=value,...` -> (NAME, {key: value}); a name without `@` has no overrides."""
    base, at, rest = name.partition("@")
    if not at:
        return name, {}
    pairs = [item.partition("=") for item in rest.split(",")]
    return base, {k.strip(): v.strip() for k, _, v in pairs}


def _layers(name: str, base: Preset, overrides: dict[str, str], full: int) -> int:
    example = f"{base.name}@{LAYERS_KEY}=8"
    unknown = sorted(set(overrides) - {LAYERS_KEY})
    if unknown:
        raise ModelError(f"preset '{name}': unknown override {', '.join(unknown)!s}; the one override is {example}")
    value = overrides.get(LAYERS_KEY, "")
    if not value.isdigit() or not 1 <= int(value) <= full:
        raise ModelError(
            f"preset '{name}': {LAYERS_KEY} must be a whole number from 1 to {full} (the shape's layers); "
            f"e.g. {example}"
        )
    return int(value)


def _base(name: str) -> Preset:
    base, _ = split_name(name)
    if base not in PRESETS:
        raise ModelError(f"unknown preset '{name}'.{did_you_mean(base, PRESETS)} Presets: {', '.join(PRESETS)}.")
    return dict.__getitem__(PRESETS, base)


def preset_config(name: str, vocab_size: int | None = None):
    """The transformers config of preset `name` (random-weight model; nothing downloaded); `NAME@layers=N` keeps
    the first N decoder layers of NAME."""
    preset = _base(name)
    _, overrides = split_name(name)
    if vocab_size is None:
        vocab_size = len(bundled_tokenizer()) if preset.uses_bundled_tokenizer else preset.vocab_size
    config = preset.build_config(vocab_size)
    if overrides:
        n = _layers(name, preset, overrides, config.num_hidden_layers)
        config.num_hidden_layers = n
        config.layer_types = list(config.layer_types[:n])
        if getattr(config, "mlp_only_layers", None):
            config.mlp_only_layers = [i for i in config.mlp_only_layers if i < n]
    return config


@functools.cache
def _cut(name: str) -> Preset:
    import torch
    from transformers import AutoModelForCausalLM

    base = _base(name)
    config = preset_config(name)  # says what is wrong with the override
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())
    full = base.build_config(base.vocab_size if not base.uses_bundled_tokenizer else 256).num_hidden_layers
    what = f"{base.name} cut to its first {config.num_hidden_layers} of {full} layers, random weights; benchmarks"
    return replace(base, name=name, description=what, build_config=lambda v: preset_config(name, v), parameters=count)


class PresetTable(dict):
    """The presets by name; `NAME@layers=N` is found too (the preset NAME cut to N layers, built on first use),
    while iterating lists the presets themselves."""

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        return dict.__contains__(self, split_name(name)[0])

    def __getitem__(self, name: str) -> Preset:
        if dict.__contains__(self, name):
            return dict.__getitem__(self, name)
        if name not in self:
            raise KeyError(name)
        return _cut(name)

    def get(self, name, default=None):
        return self[name] if name in self else default


PRESETS = PresetTable(PRESETS)
