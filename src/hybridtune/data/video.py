"""Videos as lists of frames: a content part `{"type": "video", "video": FOLDER or [frame paths], "fps": N}` (paths
relative to the data file). Every frame given is used, in order (a folder's image files by name); `fps` (default 2,
within `FPS_RANGE`: one frame an hour to 240 a second) sets the frames' timestamps. Processed as Qwen3.5's processor
does (transformers' Qwen3VLProcessor and Qwen3VLVideoProcessor): frames resized together, padded to the temporal
patch, patchified (a refusal of its resize is one line: `refused`); in the text, per temporal
group, `<{t:.1f} seconds>`, vision start, h*w/merge^2 video tokens, vision end. `get_rope_index` positions each group
as an image of grid (1, h, w) and the tower attends within each group alone, so a video is one `ImageRef` per group
(`group` >= 0, `source` its `video_key`).

`FrameProcessor` applies the checkpoint's video processor settings where the processor cannot load (it needs
torchvision, not a dependency): transformers' `smart_resize` and `patchify`, each frame resized by PIL (bicubic) as
the PIL image processors do. Pixel values then differ slightly from torchvision's resize (never the grid); see
docs/CONFIG.md (vision).
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from hybridtune.data.images import confined, image_bytes, image_source, load_image, regular
from hybridtune.errors import DataError, ModelError

VIDEO_PART_TYPE = "video"
VIDEO_KEY = "video:"  # an ImageRef.source that is a video: "video:" + JSON {"frames": [...], "fps": N}
DEFAULT_FPS = 2.0
FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")
# The rates a video's frames may be given at: the processor writes each temporal group's time as "<t seconds>" text
# (one decimal), so a rate of 1e-300 wrote a 300-digit number per group and 5e-324 "inf seconds", and beyond a few
# hundred frames a second every group reads "0.0 seconds". One frame an hour to 240 a second (high-speed capture).
FPS_RANGE = (1 / 3600, 240.0)
MAX_VIDEO_FRAMES = 768  # qwen-vl-utils' FPS_MAX_FRAMES, the most frames Qwen's own video reader samples
VIDEO_PIXEL_FRAMES = 4  # a video holds at most this many times the pixels PIL allows one image (`video_pixel_limit`)
SHAPE = '{"type": "video", "video": FOLDER or [frame paths], "fps": N}'


def is_video_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == VIDEO_PART_TYPE


def video_key(part: dict, base: Path | None, where: str, what: str) -> str:
    """The video a part names, as `ImageRef.source` holds it: its frames' resolved paths and its fps."""
    ref = part.get("video", part.get("frames", part.get("path")))
    fps = part.get("fps", DEFAULT_FPS)
    # (compared, never converted: math.isfinite of a JSON integer of 400 digits raised OverflowError, a traceback)
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not 0 < fps < math.inf:
        raise DataError(f"{where}: {what}: fps must be a positive number, got {_shown(fps)}; write the part as {SHAPE}")
    if not FPS_RANGE[0] <= fps <= FPS_RANGE[1]:
        raise DataError(
            f"{where}: {what}: fps {_shown(fps)} is outside {FPS_RANGE[0]:.6g}-{FPS_RANGE[1]:g} (one frame an hour "
            f"to {FPS_RANGE[1]:g} a second; the frames' times are written as text); give the rate the frames were "
            "sampled at"
        )
    if isinstance(ref, str) and ref.strip():
        folder = Path(image_source(ref.strip(), base, where, what))
        if not folder.is_dir():
            raise DataError(
                f"{where}: {what}: video '{folder}' is not a folder of frames (relative paths are taken from the "
                f"data file's folder); write the part as {SHAPE}"
            )
        listed = sorted(str(p) for p in folder.iterdir() if p.suffix.lower() in FRAME_SUFFIXES)
        frames = [confined(regular(f, where, what), base, where, what) for f in listed]  # (a FIFO would block)
        if not frames:
            raise DataError(
                f"{where}: {what}: video folder '{folder}' holds no image files ({', '.join(FRAME_SUFFIXES)})"
            )
    elif isinstance(ref, (list, tuple)) and ref and all(isinstance(r, str) and r.strip() for r in ref):
        frames = [image_source(r.strip(), base, where, f"{what}, frame {k}") for k, r in enumerate(ref)]
    else:
        got = "nothing" if ref is None else f"{type(ref).__name__} {str(ref)[:40]!r}"
        raise DataError(f"{where}: {what}: a video part names no frames (got {got}); write it as {SHAPE}")
    if len(frames) > MAX_VIDEO_FRAMES:  # (before any is read: a folder of 100k frames decoded for minutes)
        raise DataError(
            f"{where}: {what}: the video has {len(frames)} frames, more than {MAX_VIDEO_FRAMES} (Qwen's video reader "
            f"samples at most that many); sample the frames you train on (e.g. 2 per second) into the folder or list"
        )
    return VIDEO_KEY + json.dumps({"frames": frames, "fps": float(fps)})


def _shown(value: Any) -> str:
    """A part's value for a message: a huge integer as its magnitude (`~1e400`: its digits are no help, and past
    4300 of them Python refuses to print it), anything else as its repr, cut to 40 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > 2**64:
        return f"~{'-' if value < 0 else ''}1e{int(math.log10(abs(value)))}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def is_video_key(source: str) -> bool:
    return source.startswith(VIDEO_KEY)


def parse_key(source: str) -> tuple[list[str], float]:
    spec = json.loads(source[len(VIDEO_KEY) :])
    return spec["frames"], spec["fps"]


def describe_video(source: str) -> str:
    frames, fps = parse_key(source)
    return f"video of {len(frames)} frames at {fps:g} fps ('{frames[0]}'...)"


def load_frames(source: str, where: str, what: str, temporal: int) -> list:
    """The video's frames decoded (each checked as an image is, named by its index), all of one size."""
    frames, _ = parse_key(source)
    if len(frames) < temporal:
        raise DataError(
            f"{where}: {what}: a video needs at least {temporal} frames (the vision tower's temporal patch), got "
            f"{len(frames)}; give more frames or make it an image part"
        )
    sizes = [_header_size(f, where, f"{what}, frame {k}") for k, f in enumerate(frames)]
    for k, size in enumerate(sizes):  # (from the headers: nothing is decoded before the whole video is checked)
        if size is not None and sizes[0] is not None and size != sizes[0]:
            raise DataError(
                f"{where}: {what}: frame {k} ('{frames[k]}') is {size[0]}x{size[1]} but frame 0 is "
                f"{sizes[0][0]}x{sizes[0][1]}; a video's frames must share one size"
            )
    limit = video_pixel_limit()
    pixels = sum(w * h for w, h in (s for s in sizes if s is not None))
    if limit is not None and pixels > limit:
        w, h = next(s for s in sizes if s is not None)
        raise DataError(
            f"{where}: {what}: the video's {len(frames)} frames of {w}x{h} are {pixels} pixels, held decoded together; "
            f"over {VIDEO_PIXEL_FRAMES} x PIL's MAX_IMAGE_PIXELS ({limit} pixels), the decompression-bomb guard for a "
            "video; give fewer or smaller frames"
        )
    out = Frames(load_image(f, where, f"{what}, frame {k}") for k, f in enumerate(frames))
    out.where, out.what = where, what
    return out


class Frames(list):
    """A video's decoded frames (`load_frames`) with the row (`where`) and part (`what`) they came from, so that the
    video processor's refusal of them is one line naming both (`refused`)."""

    where = what = ""


def refused(frames: list, error: Exception) -> DataError:
    """The video processor's ValueError on `frames` as one line. Its resize scales a frame with a side under patch x
    merge so that side reaches it, truncating to integers, then refuses a ratio over 200: under some patch sizes
    (patch 5, merge 3: frames of 2090x11, 190:1 as given, become 2850x14, 203.6:1) frames that `load_image` lets
    through are refused there (none under Qwen3.5's patch 16, merge 2)."""
    at = f"{frames.where}: {frames.what}: " if getattr(frames, "where", "") else ""
    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    w, h = frames[0].width, frames[0].height
    return DataError(
        f"{at}the checkpoint's video processor refuses the video's {len(frames)} frames of {w}x{h} ({why}); crop or "
        "pad the frames nearer to square"
    )


def video_pixel_limit() -> int | None:
    """The most pixels a video's frames may hold together: `VIDEO_PIXEL_FRAMES` x PIL's MAX_IMAGE_PIXELS (each frame
    under it alone, many frames a bomb together); None where the user turned PIL's guard off."""
    from PIL import Image

    return None if Image.MAX_IMAGE_PIXELS is None else VIDEO_PIXEL_FRAMES * int(Image.MAX_IMAGE_PIXELS)


def _header_size(source: str, where: str, what: str) -> tuple[int, int] | None:
    """A frame's (width, height) from its header, not decoded; None when PIL cannot read it (`load_image` says why)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(image_bytes(source, where, what))) as im:
            return im.size
    except DataError:
        raise
    except Exception:  # (a damaged or foreign file: load_image names its fault, with its frame)
        return None


def timestamps(n_frames: int, fps: float, temporal: int) -> list[float]:
    """Each temporal group's time in seconds, as Qwen3VLProcessor computes it for frames 0..n-1 at `fps`."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor  # why here: a heavy import

    return Qwen3VLProcessor._calculate_timestamps(None, list(range(n_frames)), fps, temporal)


class FrameProcessor:
    """A Qwen3-VL video processor's settings (`processor`, its object: loadable without torchvision) applied to a
    video's decoded frames without torchvision (see the module docstring)."""

    def __init__(self, processor):
        self.processor = processor
        self.patch = int(processor.patch_size)
        self.merge = int(processor.merge_size)
        self.temporal = int(processor.temporal_patch_size)

    def __call__(self, frames: list):
        """(pixel_values float32 [t*h*w, C*temporal*patch^2], grid int64 [1, 3]) of one video."""
        import numpy as np
        import torch
        from PIL import Image
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize

        p = self.processor
        size, n = p.size, len(frames)
        lo, hi = size["shortest_edge"], size["longest_edge"]
        factor = self.patch * self.merge
        if getattr(p, "cap_pixels_per_frame", None):
            per_frame = max(min(p.max_video_tokens * factor * factor, hi // n), int(lo * 1.05))
            hi = per_frame * n
        h, w = frames[0].height, frames[0].width
        if p.do_resize:
            try:
                h, w = smart_resize(n, h, w, self.temporal, factor, lo, hi)
            except ValueError as e:
                raise refused(frames, e) from None
            frames = [f.resize((w, h), Image.Resampling.BICUBIC) for f in frames]
        video = torch.from_numpy(np.stack([np.asarray(f.convert("RGB")) for f in frames])).permute(0, 3, 1, 2)
        video = video.to(torch.float32)
        if p.do_rescale:
            video = video * p.rescale_factor
        if p.do_normalize:
            mean = torch.tensor(p.image_mean, dtype=torch.float32)[:, None, None]
            std = torch.tensor(p.image_std, dtype=torch.float32)[:, None, None]
            video = (video - mean) / std
        patches, t, gh, gw = Qwen3VLVideoProcessor.patchify(None, video[None], self.patch, self.merge, self.temporal)
        return patches[0], torch.tensor([[t, gh, gw]], dtype=torch.long)


def video_processor(directory: Path, loaded=None):
    """A callable frames -> (pixel_values, grid) for the checkpoint's videos: its loaded video processor (`loaded`,
    from AutoProcessor, torchvision present), else its `video_preprocessor_config.json` read into transformers'
    Qwen3VLVideoProcessor and applied by `FrameProcessor`; None when the checkpoint has no video processor."""
    if loaded is not None:
        return _Loaded(loaded)
    file = Path(directory) / "video_preprocessor_config.json"
    if not file.is_file():
        return None
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    cfg = json.loads(file.read_text(encoding="utf-8"))
    kind = cfg.get("video_processor_type", "Qwen3VLVideoProcessor")
    if kind != "Qwen3VLVideoProcessor":
        raise ModelError(
            f"{file}: video processor {kind} needs torchvision, which is not installed; pip install torchvision"
        )
    settings = {k: v for k, v in cfg.items() if k not in ("video_processor_type", "processor_class")}
    return FrameProcessor(Qwen3VLVideoProcessor(**settings))


class _Loaded:
    def __init__(self, processor):
        self.processor = processor
        self.temporal = int(processor.temporal_patch_size)

    def __call__(self, frames: list):
        try:
            out = self.processor(videos=[list(frames)], do_sample_frames=False, return_tensors="pt")
        except ValueError as e:  # (its resize: see `refused`)
            raise refused(frames, e) from None
        return out["pixel_values_videos"], out["video_grid_thw"]
