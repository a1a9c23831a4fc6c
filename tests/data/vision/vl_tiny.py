"""A tiny Qwen3.5 vision-language checkpoint built here (random weights, no hub): the bundled tokenizer with the
vision tokens added, a two-block vision tower (patch 4, merge 2, temporal patch 2), a Qwen2-VL image processor saved
beside it (`preprocessor_config.json`), and images written as files. Import as `from vl_tiny import ...` from the
tests of this folder."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import torch

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
TEXT = dict(
    hidden_size=64,
    num_hidden_layers=4,
    layer_types=LAYER_TYPES,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    initializer_range=0.02,
)
VISION = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)
# Resize bounds of the image processor: multiples of 8 (patch x merge) between 16x16 and 48x48 pixels.
MIN_PIXELS, MAX_PIXELS = 16 * 16, 48 * 48


def tokenizer():
    from hybridtune.models.tokenizer_files import bundled_tokenizer

    tok = copy.deepcopy(bundled_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return tok


def config(tok):
    import transformers as tf

    ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    cfg = tf.Qwen3_5Config(text_config={**TEXT, **ids}, vision_config=VISION, tie_word_embeddings=True)
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    cfg.vision_start_token_id, cfg.vision_end_token_id = start, end
    cfg.image_token_id, cfg.video_token_id = image, video
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    return cfg


def image_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = MAX_PIXELS):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=VISION["patch_size"],
        merge_size=VISION["spatial_merge_size"],
        temporal_patch_size=VISION["temporal_patch_size"],
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


def video_processor(min_pixels: int = MIN_PIXELS, max_pixels: int = 4 * MAX_PIXELS):
    """Qwen3.5's video processor (transformers' Qwen3VLVideoProcessor) for this tower: its settings (it needs
    torchvision to run; data/video.py's FrameProcessor applies them without)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(
        patch_size=VISION["patch_size"],
        merge_size=VISION["spatial_merge_size"],
        temporal_patch_size=VISION["temporal_patch_size"],
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        cap_pixels_per_frame=False,
    )


def build_model(seed: int = 0):
    """The model in fp32, eval mode, and its tokenizer."""
    import transformers as tf

    tok = tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Qwen3_5ForConditionalGeneration(config(tok))
    return model.float().eval(), tok


def make_checkpoint(directory: Path, seed: int = 0) -> Path:
    """Save the model, its tokenizer and its image processor under `directory`; returns it."""
    directory = Path(directory)
    model, tok = build_model(seed)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    image_processor().save_pretrained(str(directory))
    video_processor().save_pretrained(str(directory))
    return directory


def vision_of(tok):
    """The data side's `Vision` for this checkpoint, without a directory."""
    from hybridtune.data.video import FrameProcessor
    from hybridtune.data.vision import Vision

    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    return Vision(image_processor(), tok, image, start, end, video_id=video, video=FrameProcessor(video_processor()))


def write_image(path: Path, width: int, height: int, seed: int = 0, fmt: str = "PNG") -> Path:
    """A random RGB image of `width` x `height` pixels saved at `path`."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(path, fmt)
    return path


def write_frames(folder: Path, n: int, width: int, height: int, seed: int = 0) -> Path:
    """`n` random frames of one size, frame-000.png..., in `folder` (made); returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        write_image(folder / f"frame-{k:03d}.png", width, height, seed=seed * 1000 + k)
    return folder


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def chat(*user_parts, answer: str = "Red.") -> dict:
    """One chat row: a user message of `user_parts` (strings are text parts, dicts as they are), an answer."""
    parts = [{"type": "text", "text": p} if isinstance(p, str) else p for p in user_parts]
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]}


def spy_completions(monkeypatch, module) -> list:
    """The new token ids of every completion `module.complete` makes (generation's, or a command's own import of it),
    in order, while the test runs."""
    seen: list = []
    real = module.complete

    def spy(*a, **k):
        out = real(*a, **k)
        seen.extend(ids for ids, _ in out)
        return out

    monkeypatch.setattr(module, "complete", spy)
    return seen
