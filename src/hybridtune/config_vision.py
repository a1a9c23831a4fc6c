"""The keys of what a vision-language model trains besides its language model, by LLaMA-Factory's names, and where a
data file's images may be read from (a leaf: `config_schema.TrainConfig` inherits them; runtime/vision_train.py and
data/images.py apply them)."""

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
    allow_outside_images: bool = field(
        default=False,
        metadata={
            "help": "vision-language data: read images and video frames from anywhere (each read outside the data "
            "file's folder and image_roots is logged); false: only from there, links resolved"
        },
    )
    image_roots: list[str] = field(
        default_factory=list,
        metadata={"help": "vision-language data: folders a data file's images may also be read from (links resolved)"},
    )
