"""The optimisation keys of a run: batch and accumulation, how long it trains, the learning rate and its schedule,
the optimizer, clipping, precision, activation checkpointing and the packs' layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import Bound, at_least, in_range, key, positive

# What `learning_rate: auto` is for a preset (the demo's value; runtime/defaults.py decides it for a checkpoint), and
# the largest rate it picks.
PRESET_LEARNING_RATE = 1e-3
# No real fine-tune uses a learning rate above ~1 (they sit between 1e-6 and 1e-2); tests force a divergence with
# 1e6 on purpose. Past about 3e37 Adam's step size (lr / (1 - beta1)) overflows float32 and torch raises a bare
# RuntimeError, so refuse far below that and far above anything meaningful.
MAX_LEARNING_RATE = 1e10


def _rate(cfg) -> float:
    """The learning rate a weight decay is applied with: `auto`'s largest for auto."""
    return PRESET_LEARNING_RATE if cfg.learning_rate == "auto" else cfg.learning_rate


def _decay(cfg) -> str:
    auto = " (the largest auto learning_rate)" if cfg.learning_rate == "auto" else ""
    return (
        f"times learning_rate {_rate(cfg):g}{auto} must stay below 1 (AdamW multiplies each weight by 1 - lr x "
        "weight_decay every step); fine-tunes use 0 to 0.1"
    )


@dataclass
class OptimKeys:
    micro_batch_size: int = key(1, "packed bins per forward (laid end to end in one [1, T] row)", at_least(1))
    gradient_accumulation_steps: int = key(1, "micro-batches per optimizer step", at_least(1))
    num_epochs: float = key(2.0, "passes over the training data (ignored when max_steps > 0)", positive())
    max_steps: int = key(
        -1,
        "optimizer steps to run (-1: from num_epochs; 0: only evaluate and export the starting model)",
        at_least(-1, "must be -1 (from num_epochs), 0 (only evaluate and export) or more"),
    )
    learning_rate: Literal["auto"] | float = key(
        "auto",
        "peak learning rate; auto = 2e-4 for LoRA and 1e-5 for a full fine-tune of a checkpoint, 1e-3 for a preset",
        positive(),
        Bound(
            lambda v, cfg: v == "auto" or v <= MAX_LEARNING_RATE,
            f"must be at most {MAX_LEARNING_RATE:g} (fine-tunes use 1e-6 to 1e-2; far larger overflows the "
            "optimizer); use e.g. 1e-4",
        ),
    )
    lr_scheduler: Literal["cosine", "linear", "constant"] = key("cosine", "decay after warmup")
    warmup_steps: int = key(
        10,
        "linear warmup steps",
        at_least(0, "must be >= 0"),
        Bound(
            lambda v, cfg: cfg.warmup_ratio == 0 or v == OptimKeys.warmup_steps,
            "is set beside warmup_ratio; the two are exclusive (steps, or a share of the run): give one",
        ),
    )
    warmup_ratio: float = key(
        0.0,
        "linear warmup as a share of the run's steps, in [0, 1), instead of warmup_steps (0: warmup_steps)",
        in_range(0, 1, "must be in [0, 1) (a share of the steps)"),
    )
    weight_decay: float = key(
        0.0,
        "AdamW weight decay",
        at_least(0, "must be >= 0"),
        Bound(lambda v, cfg: _rate(cfg) * v < 1, _decay, training=True),
    )
    optim: Literal["adamw", "adamw_8bit", "adamw_bf16_sr", "adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit"] = key(
        "adamw", "adamw (torch's), adamw_8bit, adamw_bf16_sr (torchao's); transformers' names read as these (CONFIG.md)"
    )
    max_grad_norm: float = key(1.0, "gradient clipping (0: off)", at_least(0, "must be >= 0"))
    bf16: Literal["auto"] | bool = key("auto", "bf16 autocast: auto = on a GPU that supports it, off on CPU")
    gradient_checkpointing: Literal["auto"] | bool = key(
        "auto",
        "recompute activations in backward to save memory; auto = on when the step's GPU memory estimate without it "
        "exceeds the free memory, or when a first step without it runs out",
    )
    pack_layout: Literal["auto", "static", "dynamic"] = key(
        "auto",
        "static = every batch filled to one shape with filler documents (fewer recompiles), dynamic = no filler, "
        "auto = static under a compiled run when the filler is cheap and the model has no router loss",
    )
