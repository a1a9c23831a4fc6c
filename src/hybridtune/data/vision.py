"""Images in the data of a vision-language checkpoint, as its own processor sees them.

`Vision` (`vision_for` builds it from a checkpoint directory) holds the image processor and the tokens: a chat's
image part is rendered as the processor's placeholder (vision start, one image token, vision end); after tokenising,
`RowImages.expand` replaces each image token with the image's visual tokens (t*h*w / merge^2 of them, never trained)
and records an `ImageRef` per image (its source, grid, first token and token count) on the `Example`.

`rope_positions` gives one document's 3-D M-RoPE positions [3, n], as the checkpoint's `get_rope_index` computes them
for that document alone: text tokens count on from the last position on all three rows; an image's tokens take
(t, h, w) grid positions offset by the position before it, and the text after it starts at that offset plus
max(h, w) / merge. The collator concatenates the documents' positions: never a position counted across documents.
`Vision.pixels` turns a pack's images into the vision tower's input (pixel_values [patches, C*t*p*p], grid [I, 3]).
`Vision.model_inputs` is what the processor returns for prompts at inference: `mm_token_type_ids` beside the ids, by
which the model's own `get_rope_index` gives the visual tokens the positions `rope_positions` gives them in training.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtune.data.images import embedded, image_digest, image_source, is_image_part, load_image, part_reference
from hybridtune.data.packing import Example
from hybridtune.data.video import (
    describe_video,
    is_video_key,
    is_video_part,
    load_frames,
    parse_key,
    timestamps,
    video_key,
)
from hybridtune.errors import DataError, ModelError

logger = logging.getLogger(__name__)

LLAVA_PLACEHOLDER = "<image>"  # where a LLaVA-style row's next `images` item goes
MM_TOKEN_TYPE_IDS = "mm_token_type_ids"
# Its values, as transformers' ProcessorMixin.create_mm_token_type_ids writes them.
MM_TEXT, MM_IMAGE, MM_VIDEO = 0, 1, 2


@dataclass(frozen=True)
class ImageRef:
    """One image of a document (or one temporal group of a video's frames): where it is read from, its (t, h, w)
    patch grid, its first visual token's index in the document and its number of visual tokens."""

    source: str
    grid: tuple[int, int, int]
    offset: int
    tokens: int
    group: int = -1  # a video's temporal group (data/video.py: `source` is its `video_key`); -1 for an image


class Vision:
    """The image side of a checkpoint's processor (see the module docstring). `image_processor`: the checkpoint's
    (its `merge_size` and patch grid); the token ids are the model config's."""

    def __init__(
        self, image_processor, tokenizer, image_token_id: int, start_id: int, end_id: int, video_id=None, video=None
    ):
        self.image_processor = image_processor
        self.video_processor = video  # data/video.py's `video_processor`: frames -> (pixel_values, grid); or None
        self.tokenizer = tokenizer
        self.merge = int(getattr(image_processor, "merge_size", 1) or 1)
        self.image_token_id, self.video_token_id = int(image_token_id), video_id
        self.start_id, self.end_id = int(start_id), int(end_id)
        tokens = tokenizer.convert_ids_to_tokens([int(start_id), int(image_token_id), int(end_id)])
        self.video_token = tokenizer.convert_ids_to_tokens(int(video_id)) if video_id is not None else None
        # A tokenizer without the vision tokens (another model's, given as `tokenizer`) still trains text rows: the
        # first image refuses, saying why (`placeholder`).
        self.missing = None
        if any(t is None for t in tokens):
            self.missing = (
                f"the model's vision token ids {start_id}, {image_token_id}, {end_id} are not in its tokenizer "
                f"(vocabulary of {len(tokenizer)}), so its images cannot be tokenised; use the tokenizer saved with "
                "the checkpoint"
            )
        self.image_token = tokens[1]
        self._placeholder = "".join(t or "" for t in tokens)

    def video_placeholder(self, where: str, what: str) -> str:
        """What one video part renders as (vision start, the video token, vision end), as Qwen3.5's chat template
        writes it; transformers 5.17's processor keeps these two around the video's frame groups."""
        if self.video_token is None:
            raise DataError(f"{where}: {what}: the model has no video token (video_token_id); drop the video part")
        return self.placeholder.replace(self.image_token, self.video_token)

    @property
    def placeholder(self) -> str:
        """What one image part renders as: vision start, the image token, vision end."""
        if self.missing:
            raise ModelError(self.missing)
        return self._placeholder

    def fingerprint(self) -> str:
        """What the visual tokens of an image depend on: the image processor's settings and the tokens."""
        settings = self.image_processor.to_json_string() if hasattr(self.image_processor, "to_json_string") else ""
        parts = [type(self.image_processor).__name__, settings, self._placeholder, str(self.image_token_id)]
        video = getattr(self.video_processor, "processor", None)
        if video is not None and hasattr(video, "to_json_string"):
            parts += [type(self.video_processor).__name__, video.to_json_string(), str(self.video_token_id)]
        return hashlib.sha256("\0".join(parts).encode()).hexdigest()

    def process(self, images: list) -> tuple[Any, Any]:
        """(pixel_values float32 [patches, C*t*p*p], grid int64 [len(images), 3]) of decoded images, in order."""
        out = self.image_processor(images=images, return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def pixels(self, refs: Sequence[ImageRef]):
        """The vision tower's input for a pack's images and video frame groups (in order); a DataError when an image
        is gone or has changed size since it was tokenised. A video's group is fed as an image of grid (1, h, w): the
        tower attends within each frame group alone, so this equals the video run whole (data/video.py)."""
        import torch  # why here: data/ rows are torch-free until collation

        stills = [r for r in refs if r.group < 0]
        values, grid = (
            self.process([load_image(r.source, describe_ref(r), "image") for r in stills]) if stills else (None, None)
        )
        for r, g in zip(stills, grid.tolist() if stills else ()):
            _check_grid(r, g)
        if len(stills) == len(refs):
            return values.to(torch.float32), grid.to(torch.long)
        chunks = iter(torch.split(values, grid.prod(-1).tolist())) if stills else iter(())
        videos: dict[str, tuple] = {}
        out = []
        for r in refs:
            if r.group < 0:
                out.append(next(chunks))
                continue
            if r.source not in videos:
                videos[r.source] = self.video(r.source, describe_ref(r), "video")
            vals, (t, h, w) = videos[r.source]
            _check_grid(r, (1, h, w) if r.group < t else (0, h, w))
            out.append(vals[r.group * h * w : (r.group + 1) * h * w])
        return torch.cat(out).to(torch.float32), torch.tensor([r.grid for r in refs], dtype=torch.long)

    def video(self, source: str, where: str, what: str) -> tuple[Any, tuple[int, int, int]]:
        """(pixel_values, (t, h, w)) of one video (`source`: a `video_key`), through the checkpoint's video
        processor."""
        if self.video_processor is None:
            raise DataError(
                f"{where}: {what}: the checkpoint has no video processor (video_preprocessor_config.json), so its "
                "videos cannot be read; copy the processor files of its release beside it, or drop the part"
            )
        frames = load_frames(source, where, what, self.video_processor.temporal)
        values, grid = self.video_processor(frames)
        return values, tuple(int(x) for x in grid[0].tolist())

    def token_types(self, input_ids):
        """`mm_token_type_ids` of `input_ids` (a tensor [B, T]), as the checkpoint's processor returns it beside them:
        MM_IMAGE at image tokens, MM_VIDEO at video tokens, MM_TEXT elsewhere (padding too)."""
        out = (input_ids == self.image_token_id).long() * MM_IMAGE
        if self.video_token_id is not None:
            out += (input_ids == int(self.video_token_id)).long() * MM_VIDEO
        return out

    def model_inputs(self, encoded: dict, images: dict | None = None, videos: dict | None = None) -> dict:
        """Every input the checkpoint's processor returns for prompts whose visual tokens are widened (`encoded`: the
        tokenizer's input_ids and attention_mask [B, T]), the images' `pixel_values` / `image_grid_thw` and the videos'
        `pixel_values_videos` / `video_grid_thw`: with `mm_token_type_ids`, by which the model's `get_rope_index`
        places each image and video frame group at its M-RoPE grid positions, as training does (`rope_positions`);
        without it they took text positions at inference. The one place generation builds a model's visual inputs."""
        types = self.token_types(encoded["input_ids"])
        return {**encoded, MM_TOKEN_TYPE_IDS: types, **(images or {}), **(videos or {})}

    def tokens_of(self, grid: Sequence[int]) -> int:
        t, h, w = grid
        return int(t) * int(h) * int(w) // (self.merge * self.merge)


def describe_ref(ref: ImageRef) -> str:
    if is_video_key(ref.source):
        return describe_video(ref.source)
    return ref.source if not ref.source.startswith("data:") else ref.source[:40] + "..."


def _check_grid(r: ImageRef, g) -> None:
    if tuple(g) != tuple(r.grid):
        raise DataError(
            f"{describe_ref(r)}: the image changed since it was tokenised (patch grid {tuple(g)}, was "
            f"{tuple(r.grid)}); run again to tokenise the data anew"
        )


class RowImages:
    """The images of one row, in the order its parts are rendered: `part` records an image part and returns its
    placeholder text, `text` does the same for each `<image>` placeholder of a text with the next image of the row's
    `images` column (LLaVA-style rows, `column`); `expand` puts the visual tokens into the tokenised row."""

    def __init__(self, vision: Vision, base: Path | None):
        self.vision, self.base = vision, base
        self.sources: list[str] = []
        self.whats: list[str] = []
        self.pending: list = []  # the `images` column's items
        self.taken = 0

    def column(self, value: Any, where: str) -> None:
        """The row's `images` column: a list of image paths (or one path)."""
        items = column_items(value)
        if items is None:
            shown = type(value).__name__
            raise DataError(
                f"{where}: column 'images' must be a list of image paths, got a {shown}; fix the row (images a "
                "datasets Image feature holds are read too)"
            )
        self.pending = items

    def text(self, text: str, where: str, what: str) -> str:
        """`text` with each `<image>` placeholder replaced by the processor's, taking the column's next image."""
        if LLAVA_PLACEHOLDER not in text:
            return text
        head, *tails = text.split(LLAVA_PLACEHOLDER)
        out = [head]
        for tail in tails:
            if self.taken >= len(self.pending):
                raise DataError(
                    f"{where}: {what}: more {LLAVA_PLACEHOLDER} placeholders than the {len(self.pending)} image(s) of "
                    "column 'images'; give one image per placeholder"
                )
            k, self.taken = self.taken, self.taken + 1
            item = f"column 'images', item {k}"
            self.sources.append(image_source(self.pending[k], self.base, where, item))
            self.whats.append(item)
            out += [self.vision.placeholder, tail]
        return "".join(out)

    def part(self, part: dict, where: str, what: str) -> str:
        if is_video_part(part):
            self.sources.append(video_key(part, self.base, where, what))
            self.whats.append(what)
            return self.vision.video_placeholder(where, what)
        source = image_source(part_reference(part, where, what), self.base, where, what)
        self.sources.append(source)
        self.whats.append(what)
        return self.vision.placeholder

    def expand(self, ex: Example, where: str) -> Example:
        v = self.vision
        if self.taken < len(self.pending):
            raise DataError(
                f"{where}: column 'images' holds {len(self.pending)} image(s) but the text has {self.taken} "
                f"{LLAVA_PLACEHOLDER} placeholder(s); put one {LLAVA_PLACEHOLDER} where each image goes"
            )
        kinds = {v.image_token_id: "image"} | ({v.video_token_id: "video"} if v.video_token_id is not None else {})
        at = [i for i, t in enumerate(ex.input_ids) if t in kinds]
        wanted = ["video" if is_video_key(s) else "image" for s in self.sources]
        if [kinds[ex.input_ids[i]] for i in at] != wanted:
            got = [kinds[ex.input_ids[i]] for i in at]
            raise DataError(
                f"{where}: the rendered row holds {got.count('image')} image token(s) {v.image_token!r} and "
                f"{got.count('video')} video token(s) for {wanted.count('image')} image part(s) and "
                f"{wanted.count('video')} video part(s); remove such tokens written as text, or use a chat template "
                "that renders every part"
            )
        if not at:
            return ex
        ids, mask, refs, prev = [], [], [], 0
        for i, source, what in zip(at, self.sources, self.whats):
            ids += ex.input_ids[prev:i]
            mask += ex.loss_mask[prev:i]
            prev = i + 1
            if is_video_key(source):
                self._video(source, where, what, ids, refs)
                mask += [0] * (len(ids) - len(mask))  # never a target: timestamps and frames are the user's
                continue
            _, grid = v.process([load_image(source, where, what)])
            g = tuple(int(x) for x in grid[0].tolist())
            n = v.tokens_of(g)
            refs.append(ImageRef(source, g, len(ids), n))
            ids += [v.image_token_id] * n
            mask += [0] * n  # never a target: the model predicts text, not image features
        ids += ex.input_ids[prev:]
        mask += ex.loss_mask[prev:]
        return Example(ids, mask, tuple(refs))

    def _video(self, source: str, where: str, what: str, ids: list, refs: list) -> None:
        """The video's tokens in place of its video token, as Qwen3VLProcessor writes them: per temporal group, its
        timestamp `<t seconds>`, vision start, h*w/merge^2 video tokens, vision end (data/video.py)."""
        v = self.vision
        _, (t, h, w) = v.video(source, where, what)
        frames, fps = parse_key(source)
        n = h * w // (v.merge * v.merge)
        for g, seconds in enumerate(timestamps(len(frames), fps, v.video_processor.temporal)[:t]):
            ids += v.tokenizer.encode(f"<{seconds:.1f} seconds>", add_special_tokens=False) + [v.start_id]
            refs.append(ImageRef(source, (1, h, w), len(ids), n, g))
            ids += [v.video_token_id] * n + [v.end_id]


def rope_positions(length: int, images: Sequence[ImageRef], merge: int):
    """int64 [3, length]: one document's M-RoPE positions (temporal, height, width), see the module docstring."""
    import torch  # why here: see `Vision.pixels`

    out = torch.empty(3, length, dtype=torch.long)
    pos = at = 0
    for im in sorted(images, key=lambda r: r.offset):
        out[:, at : im.offset] = torch.arange(pos, pos + im.offset - at)
        pos += im.offset - at
        t, h, w = im.grid[0], im.grid[1] // merge, im.grid[2] // merge
        if t * h * w != im.tokens:
            raise ValueError(f"image {im.source}: grid {im.grid} / merge {merge} is not its {im.tokens} tokens")
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, im.offset : im.offset + im.tokens] = grid.reshape(3, -1) + pos
        pos += max(im.grid[1], im.grid[2]) // merge
        at = im.offset + im.tokens
    out[:, at:] = torch.arange(pos, pos + length - at)
    return out


def row_references(value: Any) -> Iterable[dict]:
    """Every image or video part anywhere in a row's value (messages, their content lists, prompt/completion lists)."""
    if is_image_part(value) or is_video_part(value):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from row_references(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from row_references(v)


def column_items(value: Any) -> list[str] | None:
    """An `images` column's paths ([] for none), or `data:` URIs of the images a `datasets` Image feature holds;
    None when it is not a list of these."""
    if value is None or (isinstance(value, (str, list, tuple)) and len(value) == 0):
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return None
    items = [embedded(v) or v for v in value]
    if all(isinstance(v, str) and v.strip() for v in items):
        return [v.strip() for v in items]
    return None


def media_digest(rows: Iterable[tuple[dict, Path | None]], vision: Vision) -> str:
    """sha256 over the processor's fingerprint and every image the rows name (its resolved source and the sha256 of
    its bytes): part of the tokenisation cache key, so a changed image is tokenised again. Rows come with the folder
    their relative paths are taken from; a part that cannot be resolved is left to tokenising to report."""
    h = hashlib.sha256(vision.fingerprint().encode())
    for row, base in rows:
        column = column_items(row.get("images")) if isinstance(row, dict) else None
        for part in [*row_references(row), *({"type": "image", "image": p} for p in column or ())]:
            try:
                if is_video_part(part):
                    key = video_key(part, base, "", "")
                    sources = [key, *parse_key(key)[0]]
                else:
                    sources = [image_source(part_reference(part, "", ""), base, "", "")]
            except DataError:
                h.update(b"refused\0")
                continue
            for source in sources:
                digest = "video" if is_video_key(source) else image_digest(source)
                h.update(source.encode() + b"\0" + digest.encode() + b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=256)
def _folder_of(label: str, data_path: str) -> Path | None:
    if Path(label).is_file():
        return Path(label).resolve().parent
    return Path(data_path).resolve() if Path(data_path).is_dir() else None


def row_base(segments: Sequence, i: int, data_path: str, starts: Sequence[int] | None = None) -> Path | None:
    """The folder relative image paths of row `i` are taken from: its data file's (a segment's label), else the
    data directory; None (the working directory) for data without local files (a dataset id)."""
    starts = starts if starts is not None else [s.start for s in segments]
    return _folder_of(segments[bisect.bisect_right(starts, i) - 1].label, data_path)


def log_visual_tokens(name: str, examples: Sequence[Example]) -> None:
    """One line: the images of a data source and their visual tokens per image (least, mean, most)."""
    counts = [im.tokens for ex in examples for im in ex.images]
    if counts:
        logger.info(
            "dataset %s: %d images in %d examples, visual tokens per image %d / %.0f / %d (least / mean / most)",
            name,
            len(counts),
            sum(1 for ex in examples if ex.images),
            min(counts),
            sum(counts) / len(counts),
            max(counts),
        )
