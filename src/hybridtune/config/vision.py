"""The keys of what a vision-language model trains besides its language model, by LLaMA-Factory's names, and where a
data file's images may be read from (runtime/vision_train.py and data/images.py apply them)."""

from __future__ import annotations

from dataclasses import dataclass

from hybridtune.config.keys import key


@dataclass
class VisionKeys:
    freeze_vision_tower: bool = key(
        True,
        "vision-language models: keep the vision tower frozen; false trains it as the language model is "
        "(LoRA on its Linear layers under adapter: lora, every parameter under adapter: full)",
    )
    freeze_multi_modal_projector: bool = key(
        True,
        "vision-language models: keep the merger (the projector into the language model) frozen; false "
        "trains it as the language model is (LoRA on its Linear layers, or every parameter)",
    )
    allow_outside_images: bool = key(
        False,
        "vision-language data: read images and video frames from anywhere (each read outside the data "
        "file's folder and image_roots is logged); false: only from there, links resolved",
    )
    image_roots: list[str] = key(
        [], "vision-language data: folders a data file's images may also be read from (links resolved)"
    )
