"""`python -m hybridtune.infer.vl_demo OUT`: the vision-language CPU demo's model and data, written under OUT.

OUT/tiny-qwen3_5-vl/ is a tiny Qwen3.5 vision-language checkpoint with random weights (the bundled tokenizer with
the vision tokens added, a two-block vision tower, Qwen2-VL's PIL image processor and Qwen3-VL's video processor
settings: no download, no torchvision);
OUT/shapes/ holds a synthetic image task, train.jsonl and test.jsonl: chat rows asking "Which colour is the
square?" of a 32x32 picture with a square and a circle of two different colours, answered with the square's colour.
docs/CONFIG.md gives the commands that train on it and measure exact match before and after.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (40, 60, 220), "yellow": (230, 200, 20)}
QUESTION = "Which colour is the square?"
SIZE = 32  # pixels a side: 8x8 patches of 4, 16 visual tokens after the 2x2 merge
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MODEL_DIR, DATA_DIR = "tiny-qwen3_5-vl", "shapes"


def draw(rng: random.Random, square: str, circle: str):
    """A SIZE x SIZE picture: a square of colour `square` and a circle of colour `circle`, apart, on light grey."""
    from PIL import Image, ImageDraw  # why here: only the demo draws

    im = Image.new("RGB", (SIZE, SIZE), (235, 235, 235))
    d = ImageDraw.Draw(im)
    a, b = rng.randint(8, 12), rng.randint(8, 12)  # sides
    left = rng.random() < 0.5  # the square on the left or the right half
    x0, x1 = (
        (rng.randint(0, 15 - a), rng.randint(16, SIZE - b))
        if left
        else (rng.randint(16, SIZE - a), rng.randint(0, 15 - b))
    )
    y0, y1 = rng.randint(0, SIZE - a), rng.randint(0, SIZE - b)
    d.rectangle([x0, y0, x0 + a - 1, y0 + a - 1], fill=COLOURS[square])
    d.ellipse([x1, y1, x1 + b - 1, y1 + b - 1], fill=COLOURS[circle])
    return im


def write_data(out: Path, train: int = 400, test: int = 100, seed: int = 0) -> tuple[Path, Path]:
    """train.jsonl and test.jsonl under `out`, their images under out/img/ (paths relative to the files)."""
    rng = random.Random(seed)
    (out / "img").mkdir(parents=True, exist_ok=True)
    files = []
    for split, n in (("train", train), ("test", test)):
        rows = []
        for k in range(n):
            square, circle = rng.sample(sorted(COLOURS), 2)
            name = f"img/{split}-{k:04d}.png"
            draw(rng, square, circle).save(out / name)
            parts = [{"type": "image", "image": name}, {"type": "text", "text": QUESTION}]
            answer = square.capitalize() + "."
            rows.append({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}]})
        files.append(out / f"{split}.jsonl")
        files[-1].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return files[0], files[1]


def write_model(out: Path, seed: int = 0) -> Path:
    """The tiny vision-language checkpoint under `out` (random weights drawn from `seed`)."""
    import copy

    import torch
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    from hybridtune.models.tokenizer_files import bundled_tokenizer

    tok = copy.deepcopy(bundled_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    n = 4
    text = dict(
        vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, hidden_size=128,
        num_hidden_layers=n, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        intermediate_size=352, num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, initializer_range=0.02,
    )  # fmt: skip
    vision = dict(
        depth=2, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128, patch_size=4,
        spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
    )  # fmt: skip
    cfg = tf.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id = (
        start,
        end,
        image,
        video,
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = tf.Qwen3_5ForConditionalGeneration(cfg).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=SIZE * SIZE, max_pixels=SIZE * SIZE,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(str(out))  # fmt: skip
    sizes = {"shortest_edge": SIZE * SIZE, "longest_edge": 4 * SIZE * SIZE}  # (data/video.py applies these settings)
    Qwen3VLVideoProcessor(
        patch_size=4, merge_size=2, temporal_patch_size=2, size=sizes, image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5], cap_pixels_per_frame=False,
    ).save_pretrained(str(out))  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybridtune.infer.vl_demo", description=__doc__)
    parser.add_argument("out", metavar="OUT", help="the folder to write the model and the data under")
    parser.add_argument("--train", type=int, default=400, help="training rows (400)")
    parser.add_argument("--test", type=int, default=100, help="test rows (100)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pictures and the weights")
    args = parser.parse_args(argv)
    out = Path(args.out)
    write_data(out / DATA_DIR, args.train, args.test, args.seed)
    write_model(out / MODEL_DIR, args.seed)
    print(f"wrote {out / MODEL_DIR}/ (random weights) and {out / DATA_DIR}/train.jsonl, test.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
