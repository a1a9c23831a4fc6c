"""The keys of what a vision-language model trains besides its language model, by LLaMA-Factory's names (a leaf:
`config_schema.TrainConfig` inherits them; runtime/vision_train.py applies them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class VisionKeys:
    freeze_vision_tower: bool = field(
        default=True,
        metadata={
            "help": "vision-language models: keep the vision tower frozen; false trains it as the language model is "
            "(LoRA on its Linear layers under adapter: lora, every parameter under adapter: full)"
        },
    )
    freeze_multi_modal_projector: bool = field(
        default=True,
        metadata={
            "help": "vision-language models: keep the merger (the projector into the language model) frozen; false "
            "trains it as the language model is (LoRA on its Linear layers, or every parameter)"
        },
    )
