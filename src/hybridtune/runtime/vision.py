"""A vision-language checkpoint's image side at run time: `vision_for` builds the data side (`data.vision.Vision`)
from the checkpoint's own processor, and `image_embeds` runs the vision tower over a pack's images and puts their
features at the image tokens (`model_inputs(batch, model=...)`, runtime/step.py, calls it).

The tower runs once over all images of the pack, its attention split per image by its own `cu_seqlens` (from
`image_grid_thw`), and never receives the text's packing keywords: its forward would read `cu_seq_lens_q` or
`position_ids` passed on to it as its own. The model's forward then takes `inputs_embeds`, as transformers' own
forward does after the same scatter.
"""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import torch

from hybridtune.batch import IMAGE_GRID_THW, INPUT_IDS, PIXEL_VALUES
from hybridtune.data.video import video_processor
from hybridtune.data.vision import MM_TOKEN_TYPE_IDS, Vision
from hybridtune.errors import ConfigError, ModelError
from hybridtune.models.anatomy import unwrap
from hybridtune.models.trust import from_pretrained, refuse_custom_code

logger = logging.getLogger(__name__)


IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")  # where AutoImageProcessor reads


def vision_for(
    source, tokenizer, min_pixels: int | None = None, max_pixels: int | None = None, recorded: bool = False
) -> Vision | None:
    """The `Vision` of a vision-language checkpoint (`source`: a `models.hub.ModelSource` or a directory): its
    config has a `vision_config` and an `image_token_id`, and its processor files hold an image processor. None for a
    text-only model or a preset. `min_pixels` / `max_pixels` bound the processor's resize (None: the checkpoint's);
    given for a text-only model they are refused, unless `recorded` (a trained run's config, which nobody can edit
    now: they resize nothing there)."""
    sizes = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
    directory = getattr(source, "path", source)
    cfg_file = Path(directory or ".") / "config.json"
    cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if directory is not None and cfg_file.is_file() else {}
    if not cfg.get("vision_config") or cfg.get("image_token_id") is None:
        if sizes and not recorded:  # (they were ignored, as if the run had images to resize)
            key, value = next(iter(sizes.items()))
            raise ConfigError(
                f"config key '{key}' = {value}: this model takes no images (a text-only model), so it would resize "
                "nothing; remove it from the config"
            )
        return None
    directory = Path(directory)
    refuse_custom_code(directory)
    ids = [cfg.get(k) for k in ("image_token_id", "vision_start_token_id", "vision_end_token_id")]
    if any(i is None for i in ids):
        raise ModelError(f"{cfg_file} has image_token_id but no vision_start_token_id / vision_end_token_id")
    if not any((directory / f).is_file() for f in IMAGE_PROCESSOR_FILES):  # saved without them: text still trains
        vision = Vision(None, tokenizer, *ids, video_id=cfg.get("video_token_id"))
        vision.missing = (
            f"{directory} is a vision-language checkpoint saved without its processor files "
            f"({' / '.join(IMAGE_PROCESSOR_FILES)}), so an image cannot be read; copy the processor files of its "
            "release beside it"
        )
        logger.info("vision: %s has no processor files: text trains, the first image is refused", directory)
        return vision
    processor, video = _image_processor(directory, sizes)
    video = video_processor(directory, video) if cfg.get("video_token_id") is not None else None
    vision = Vision(processor, tokenizer, *ids, video_id=cfg.get("video_token_id"), video=video)
    logger.info(
        "vision: %s from %s (merge %d, resize bounds %s)", type(processor).__name__, directory, vision.merge, sizes or
        "the checkpoint's",
    )  # fmt: skip
    return vision


def _image_processor(directory: Path, sizes: dict):
    """The checkpoint's image processor and video processor: its `AutoProcessor`'s, or `AutoImageProcessor` alone
    (and no video processor: data/video.py reads its settings) when the processor needs torchvision for its video
    processor and it is not installed."""
    from transformers.models.auto.image_processing_auto import AutoImageProcessor  # why here: torch-heavy import
    from transformers.models.auto.processing_auto import AutoProcessor

    try:
        processor = from_pretrained(AutoProcessor, directory, **sizes)
        image = getattr(processor, "image_processor", None)
        if image is not None:
            return image, getattr(processor, "video_processor", None)
    except (ImportError, OSError, ValueError, TypeError) as e:
        # transformers raises ValueError ("... requires `torchvision` to be installed") from its video processor
        # auto-class, ImportError from a backend check: both leave the image processor itself loadable
        needs_torchvision = "torchvision" in str(e).lower()
        if not (needs_torchvision or isinstance(e, ImportError)):
            raise ModelError(f"the processor files of {directory} cannot be read ({_line(e)})") from None
        why = "its video processor needs torchvision, not installed" if needs_torchvision else _line(e)
        logger.info("vision: the processor of %s cannot load (%s); its image processor alone", directory, why)
    try:
        return from_pretrained(AutoImageProcessor, directory, **sizes), None
    except (OSError, ValueError, TypeError, ImportError) as e:
        raise ModelError(
            f"{directory} is a vision-language checkpoint without a readable image processor "
            f"(preprocessor_config.json: {_line(e)}); copy the processor files of its release beside it"
        ) from None


def _line(e: BaseException) -> str:
    return next((s.strip() for s in str(e).splitlines() if s.strip()), type(e).__name__)


def image_embeds(model: torch.nn.Module, kwargs: dict) -> dict:
    """`kwargs` (model_inputs') with the pack's images turned into `inputs_embeds`: the token embeddings with each
    image (or video) token's row replaced by the vision tower's feature for it, in order; unchanged without images."""
    pixels, grid = kwargs.pop(PIXEL_VALUES, None), kwargs.pop(IMAGE_GRID_THW, None)
    if pixels is None:
        return kwargs
    base = unwrap(model)
    ids = kwargs.pop(INPUT_IDS)
    embeds = base.get_input_embeddings()(ids)
    features = base.get_image_features(pixel_values=pixels, image_grid_thw=grid, return_dict=True).pooler_output
    features = torch.cat(list(features), 0).to(embeds.dtype)
    mask = ids == base.config.image_token_id
    video = getattr(base.config, "video_token_id", None)
    if video is not None:  # a video's frame groups, in token order with the images (data/vision.py `pixels`)
        mask = mask | (ids == video)
    mask = mask.unsqueeze(-1)
    kwargs["inputs_embeds"] = embeds.masked_scatter(mask, features)
    return kwargs


# What generation passes a vision-language model beside its pixels (data.vision.Vision.model_inputs), by name.
ROPE_INPUTS = ("input_ids", "attention_mask", MM_TOKEN_TYPE_IDS, IMAGE_GRID_THW, "video_grid_thw")


def check_rope_inputs(model: torch.nn.Module, inputs: dict) -> None:
    """A ModelError (one line) when the model's `get_rope_index` reads an input that `inputs` (what generation
    passes it, with images or videos) does not hold: a transformers version whose M-RoPE needs more than the
    processor's inputs hybridtune builds would otherwise place the visual tokens at text positions, unlike training,
    without a word. An input that gives the grids of a modality the prompts lack is not needed."""
    base = unwrap(model)
    get = getattr(getattr(base, "model", base), "get_rope_index", None)
    if get is None:
        return
    params = inspect.signature(get).parameters.values()
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    unknown = [n for n in named if n not in ROPE_INPUTS]
    missing = unknown + [n for n in (MM_TOKEN_TYPE_IDS,) if n in named and n not in inputs]
    if missing:
        raise ModelError(
            f"{type(base).__name__}.get_rope_index (transformers) reads {', '.join(missing)}, which hybridtune's "
            "generation does not pass, so its images and videos would take other positions than in training; use "
            "the transformers version pinned by hybridtune"
        )
