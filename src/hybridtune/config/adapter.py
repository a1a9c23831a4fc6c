"""The adapter keys of a run: a full fine-tune, LoRA, or QLoRA (LoRA over a 4-bit base), and LoRA's rank, scale,
dropout and targets (modules, or parameters such as the routed experts' weights)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import Bound, at_least, in_range, key

# Default LoRA targets: attention projections, the linear-attention mixers' projections and the MLP (dense and MoE
# experts' shared MLP). Names that a model lacks are simply not matched; at least one must match.
DEFAULT_LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]

# `lora_target_modules: all-linear` (peft's spelling): every Linear of the text model's decoder layers.
ALL_LINEAR = "all-linear"


@dataclass
class AdapterKeys:
    adapter: Literal["lora", "qlora", "full"] = key("full", "full fine-tune (default), lora (peft), qlora (4-bit base)")
    load_in_4bit: bool = key(
        False,
        "QLoRA: the frozen base's linear and expert weights in 4-bit NF4 while loading",
        Bound(lambda v, cfg: not v or cfg.adapter == "lora", "needs adapter: lora (a frozen base)"),
    )

    def __post_init__(self) -> None:  # adapter: qlora is Axolotl's spelling of lora + load_in_4bit
        if self.adapter == "qlora":
            self.adapter, self.load_in_4bit = "lora", True

    lora_r: int = key(16, "LoRA rank", at_least(1))
    lora_alpha: int = key(
        32, "LoRA alpha (scale = alpha / r)", at_least(1, "must be at least 1 (the LoRA scale is alpha / r)")
    )
    lora_dropout: float = key(0.0, "LoRA dropout", in_range(0.0, 1.0, "must be in [0, 1)"))
    lora_target_modules: list[str] = key(
        list(DEFAULT_LORA_TARGETS),
        "module names that get LoRA, or all-linear (every Linear of the text model's decoder layers, as peft's)",
        Bound(
            lambda v, cfg: ALL_LINEAR not in v or v == [ALL_LINEAR],
            f"names {ALL_LINEAR} beside other modules; give {ALL_LINEAR} alone or a list of names",
        ),
    )
    lora_target_parameters: list[str] = key(
        [],
        "parameters that get LoRA through peft's target_parameters (a parameter name's end): the routed experts' "
        "weights such as [gate_up_proj, down_proj], as grouped GEMMs; needs lora_dropout: 0",
    )
