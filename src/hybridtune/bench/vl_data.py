"""The bench's vision-language data and model (`hybridtune bench --vision`; docs/CONFIG.md, "Benchmarking
vision-language training"): a random-weight Qwen3.5 VL checkpoint of a preset's text shape and synthetic image-text
documents, the same for every mode.

`write_checkpoint`: the preset's text config under `Qwen3_5Config` with a tower (`vision_config`; `VISION_2B` for the
2B shape), the bundled tokenizer with the vision tokens, Qwen2-VL's PIL image processor (patch 16, merge 2, mean =
std = 0.5), weights drawn (seeded) and saved. `make_documents`: 1-4 images per document of 256-1,280 visual tokens
each (whole merged patches, smooth random pixels), 8-64 untrained text tokens before each image, an answer of 32-512
trained tokens; each grid read back through the processor; every range scaled down by one factor where the longest
document would not fit sequence_len; packed by hybridtune's packing, the `layouts` fullest packs kept.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

IMAGES = (1, 4)
VISUAL = (256, 1280)
PROMPT = (8, 64)
ANSWER = (32, 512)
LONGEST = IMAGES[1] * (VISUAL[1] + PROMPT[1] + 2) + ANSWER[1]  # a document at its longest
SHORTEST = 1 + 1 + 1 + 1 + 2  # the smallest scale's shortest: a prompt token, start, one visual token, end, 2
# Every document is drawn as images and read back through the processor: past this many tokens a pack, the
# drawing takes longer than any bench (hybridtune bench --vision refuses more).
MAX_SEQUENCE_LEN = 131_072
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
MODEL_DIR, DATA_DIR, DOCS_FILE = "vl-model", "vl-data", "documents.json"

# The 2B's tower: Qwen3-VL-2B's (24 blocks, width 1024, MLP 4096, 16 heads, patch 16, merge 2; e.g. InfiniCore's
# Qwen3-VL meta lists vision_hidden_size 1024, 24 layers, 16 heads, patch 16, out_hidden_size 2048), which
# Qwen3.5-2B's config.json carries to our knowledge: NOT checked against the hub file (no hub here).
VISION_2B = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=2304,
)
VISION_TINY = dict(
    depth=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
)


def scale(seq_len: int) -> float:
    """The factor on every length range: 1 when the longest document fits `seq_len`."""
    return min(1.0, seq_len / LONGEST)


def _range(r: tuple[int, int], s: float, least: int = 1) -> tuple[int, int]:
    return max(least, round(r[0] * s)), max(least, round(r[1] * s))


def vision_config(text) -> dict:
    """The tower for a text config (see the module docstring)."""
    if text.hidden_size < 1024:
        tower = dict(VISION_TINY)
    elif text.hidden_size < 4096:
        tower = dict(VISION_2B)
    else:
        tower = {}  # transformers' Qwen3_5VisionConfig defaults
    return {**tower, "out_hidden_size": text.hidden_size}


def write_checkpoint(directory: Path, preset: str, seed: int, dtype: str = "float32") -> Path:
    """The random-weight VL checkpoint of `preset`'s text shape under `directory` (see the module docstring)."""
    import copy

    import torch
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hybridtune.models.presets import PRESETS, preset_config
    from hybridtune.models.tokenizer_files import bundled_tokenizer

    tok = copy.deepcopy(bundled_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    p = PRESETS[preset]
    text = preset_config(preset, len(tok) if p.uses_bundled_tokenizer else max(p.vocab_size, len(tok)))
    if text.model_type != "qwen3_5_text":
        raise ValueError(f"--vision needs a dense Qwen3.5 preset (a qwen3_5_text shape), not {preset}")
    text_dict = text.to_dict()
    text_dict.update(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    tower = vision_config(text)
    cfg = tf.Qwen3_5Config(text_config=text_dict, vision_config=tower, tie_word_embeddings=text.tie_word_embeddings)
    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.image_token_id, cfg.video_token_id = (
        start,
        end,
        image,
        video,
    )
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = tf.Qwen3_5ForConditionalGeneration(cfg).to(getattr(torch, dtype))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    del model
    tok.save_pretrained(str(directory))
    factor = cfg.vision_config.patch_size * cfg.vision_config.spatial_merge_size
    Qwen2VLImageProcessorPil(
        patch_size=cfg.vision_config.patch_size,
        merge_size=cfg.vision_config.spatial_merge_size,
        temporal_patch_size=cfg.vision_config.temporal_patch_size,
        min_pixels=factor * factor,
        max_pixels=factor * factor * 4 * VISUAL[1],
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(str(directory))
    return directory


def _picture(rng, width: int, height: int, path: Path) -> None:
    """Smooth random pixels: seeded noise at 1/16 size, upsampled (a photo's spread of values, cheap to encode)."""
    import numpy as np
    from PIL import Image

    small = rng.integers(0, 256, (max(1, height // 16), max(1, width // 16), 3), dtype=np.uint8)
    Image.fromarray(small).resize((width, height), Image.Resampling.BILINEAR).save(path, "JPEG", quality=90)


def make_documents(directory: Path, vision, vocab_size: int, seq_len: int, layouts: int, seed: int) -> list[list[dict]]:
    """`layouts` packs of documents (see the module docstring), each document {"ids", "mask", "images": [[source,
    grid, offset, tokens], ...]}; the images are written under `directory`/img/."""
    import numpy as np

    from hybridtune.data.packing import pack

    if not SHORTEST <= seq_len <= MAX_SEQUENCE_LEN or layouts < 1:  # (shorter: no document fits, drawn forever)
        raise ValueError(f"sequence_len {seq_len}, layouts {layouts}: give {SHORTEST}-{MAX_SEQUENCE_LEN} and 1 or more")
    s = scale(seq_len)
    visual, prompt, answer = _range(VISUAL, s), _range(PROMPT, s), _range(ANSWER, s, 2)
    lengths, ids_rng, pixels = random.Random(seed), random.Random(seed + 1), np.random.default_rng(seed + 2)
    special = {vision.image_token_id, vision.start_id, vision.end_id, vision.video_token_id}
    factor = vision.merge * int(vision.image_processor.patch_size)
    (directory / "img").mkdir(parents=True, exist_ok=True)

    def text(n: int) -> list[int]:
        out = []
        while len(out) < n:
            t = ids_rng.randrange(1, vocab_size)
            if t not in special:
                out.append(t)
        return out

    docs, total, k = [], 0, 0
    while total < (layouts + 1) * seq_len:
        ids, mask, images = [], [], []
        for _ in range(lengths.randint(*IMAGES)):
            ids += text(lengths.randint(*prompt)) + [vision.start_id]
            n = lengths.randint(*visual)
            aspect = math.exp(lengths.uniform(math.log(0.5), math.log(2.0)))
            h = max(1, round(math.sqrt(n * aspect)))
            w = max(1, round(n / h))
            path = directory / "img" / f"{k:05d}.jpg"
            k += 1
            _picture(pixels, w * factor, h * factor, path)
            images.append((str(path), len(ids)))
            ids += [vision.image_token_id] * (h * w) + [vision.end_id]
        mask = [0] * len(ids)
        n = lengths.randint(*answer)
        ids += text(n)
        mask += [1] * n
        if len(ids) > seq_len:  # (rounding at a small scale: drawn again)
            continue
        docs.append({"ids": ids, "mask": mask, "images": images})
        total += len(ids)
    out = []
    for d in docs:  # each image's grid as the processor gives it (the drawn size: whole merged patches)
        refs = []
        for source, offset in d["images"]:
            from PIL import Image

            _, grid = vision.process([Image.open(source).convert("RGB")])
            g = [int(x) for x in grid[0].tolist()]
            tokens = vision.tokens_of(g)
            if d["ids"][offset : offset + tokens] != [vision.image_token_id] * tokens:
                raise ValueError(f"{source}: the processor resized the image (grid {g}); the bench's sizes are wrong")
            refs.append([source, g, offset, tokens])
        out.append({"ids": d["ids"], "mask": d["mask"], "images": refs})
    bins = pack([d["ids"] for d in out], seq_len)
    fullest = sorted(sorted(range(len(bins)), key=lambda i: -sum(len(out[j]["ids"]) for j in bins[i]))[:layouts])
    return [[out[j] for j in bins[i]] for i in fullest]


def prepare(out: Path, preset: str, seq_len: int, layouts: int, seed: int, dtype: str) -> dict:
    """The checkpoint (out/vl-model) and the packs (out/vl-data/documents.json, images beside it); what bench.json
    says of them."""
    from hybridtune.runtime.vision import vision_for

    model_dir = write_checkpoint(out / MODEL_DIR, preset, seed, dtype)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
    vision = vision_for(model_dir, tok)
    cfg = json.loads((model_dir / "config.json").read_text())
    packs = make_documents(out / DATA_DIR, vision, cfg["text_config"]["vocab_size"], seq_len, layouts, seed)
    (out / DATA_DIR / DOCS_FILE).write_text(json.dumps(packs))
    return describe(packs, seq_len, cfg["vision_config"])


def load_packs(out: Path) -> list[list[dict]]:
    return json.loads((Path(out) / DATA_DIR / DOCS_FILE).read_text())


def examples(pack: list[dict]) -> list:
    """A pack's documents as hybridtune `Example`s with their `ImageRef`s."""
    from hybridtune.data.packing import Example
    from hybridtune.data.vision import ImageRef

    return [
        Example(d["ids"], d["mask"], tuple(ImageRef(s, tuple(g), o, n) for s, g, o, n in d["images"])) for d in pack
    ]


def describe(packs: list[list[dict]], seq_len: int, tower: dict) -> dict:
    """What bench.json says of the vision data."""
    s = scale(seq_len)
    visual = [sum(im[3] for d in p for im in d["images"]) for p in packs]
    tokens = [sum(len(d["ids"]) for d in p) for p in packs]
    v, pr, a = _range(VISUAL, s), _range(PROMPT, s), _range(ANSWER, s, 2)
    return {
        "documents_per_pack": [len(p) for p in packs],
        "images_per_pack": [sum(len(d["images"]) for d in p) for p in packs],
        "tokens_per_pack": tokens,
        "visual_tokens_per_pack": visual,
        "fill": sum(tokens) / (len(packs) * seq_len),
        "vision_tower": tower,
        "distribution": f"image-text documents: {IMAGES[0]}-{IMAGES[1]} images of {v[0]}-{v[1]} visual tokens each "
        f"(after the merge), {pr[0]}-{pr[1]} prompt tokens before each, an answer of {a[0]}-{a[1]} trained tokens "
        "(uniform, seeded), smooth random pixels; packed by hybridtune's packing; tokens counted text + visual",
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m hybridtune.bench.vl_data")
    ap.add_argument("out")
    ap.add_argument("preset")
    ap.add_argument("--sequence_len", type=int, required=True)
    ap.add_argument("--layouts", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args(argv)
    info = prepare(Path(args.out), args.preset, args.sequence_len, args.layouts, args.seed, args.dtype)
    (Path(args.out) / DATA_DIR / "describe.json").write_text(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
