"""Built-in model presets: configs with random weights, never a download.

`tiny-*` presets are small enough to train on a 2-core CPU in minutes and use the bundled tokenizer.
The real-shape presets (`qwen3_5-0.8b`, `qwen3_5-2b`, `qwen3_5-9b`) copy the layer shapes of the
published Qwen3.5 checkpoints so that benchmarks measure realistic work; their weights are random.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hybridtune.errors import ModelError, did_you_mean
from hybridtune.models.tokenizer_files import bundled_tokenizer

# The published Qwen3.5 vocabulary; the real-shape presets keep it so the LM head costs what it costs.
QWEN3_5_VOCAB = 248320


@dataclass(frozen=True)
class Preset:
    name: str
    model_type: str  # transformers model_type of the config built
    description: str
    build_config: Callable[[int], Any]  # vocab_size -> transformers PretrainedConfig
    uses_bundled_tokenizer: bool  # tiny presets size their vocab to the bundled tokenizer
    parameters: int  # of the model built (tied weights once); a test builds each on the meta device and counts


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
    ]
}


def preset_config(name: str, vocab_size: int | None = None):
    """The transformers config of preset `name` (random-weight model; nothing downloaded)."""
    if name not in PRESETS:
        raise ModelError(f"unknown preset '{name}'.{did_you_mean(name, PRESETS)} Presets: {', '.join(PRESETS)}.")
    preset = PRESETS[name]
    if vocab_size is None:
        if preset.uses_bundled_tokenizer:
            vocab_size = len(bundled_tokenizer())
        else:
            vocab_size = QWEN3_5_VOCAB
    return preset.build_config(vocab_size)
