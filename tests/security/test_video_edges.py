"""A video's rate and the thinnest frames (red team): fps 1e-300 wrote a 300-digit "<t seconds>" per temporal group
into the trained text, 5e-324 "inf seconds", 1e9 "0.0 seconds" for every group; each rate outside one frame an
hour to 240 a second is now one line naming the row and the part, through the data and through `--fps`. Frames at
the 200:1 edge Qwen's processors allow (600x3, 3x600) and of 1-3 pixels train (the processor's own resize), 601x3 is
the aspect-ratio line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "vision"))
import vl_tiny  # noqa: E402
from vl_tiny import chat  # noqa: E402

from hybridtune.config import DatasetConfig  # noqa: E402
from hybridtune.data.examples import load_source  # noqa: E402
from hybridtune.data.video import FPS_RANGE  # noqa: E402
from hybridtune.errors import DataError  # noqa: E402
from hybridtune.infer.video_prompts import video_arg  # noqa: E402


def _load(tmp_path, tok, vision, part):
    path = tmp_path / "d.jsonl"
    vl_tiny.write_rows(path, [chat(part, {"type": "text", "text": "what"}, answer="x")])
    return load_source(DatasetConfig(path=str(path)), tok, cache=False, vision=vision).examples[0], path


@pytest.mark.parametrize("fps", [5e-324, 1e-300, 1e-9, 1 / 3601, 240.5, 1e9, 1e300])
def test_a_rate_outside_the_range_is_one_line(tmp_path, tok, vision, fps):
    vl_tiny.write_frames(tmp_path / "clip", 3, 9, 7, seed=1)
    with pytest.raises(DataError) as e:
        _load(tmp_path, tok, vision, {"type": "video", "video": "clip", "fps": fps})
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}:1: ") and "content part 0 (video)" in msg, msg
    assert f"fps {fps!r} is outside" in msg and "\n" not in msg
    with pytest.raises(DataError, match=r"^--video 1: the video: fps .* is outside"):
        video_arg(str(tmp_path / "clip"), fps, "--video 1")


@pytest.mark.parametrize("fps", [FPS_RANGE[0], 0.01, 2, 29.97, FPS_RANGE[1]])
def test_a_rate_inside_the_range_writes_its_times(tmp_path, tok, vision, fps):
    vl_tiny.write_frames(tmp_path / "clip", 4, 9, 7, seed=1)
    ex, _ = _load(tmp_path, tok, vision, {"type": "video", "video": "clip", "fps": fps})
    times = [t.split(" seconds>")[0] for t in tok.decode(ex.input_ids).split("<") if " seconds>" in t]
    assert len(times) == 2 and all(len(t) < 12 and t != "inf" for t in times), times  # 4 frames: 2 groups
    assert float(times[1]) == pytest.approx(2.5 / fps, rel=0.05, abs=0.05)  # the second group: frames 2 and 3


@pytest.mark.parametrize("size", [(600, 3), (3, 600), (1, 1), (2, 2), (3, 3)])
def test_the_thinnest_frames_train(tmp_path, tok, vision, size):
    vl_tiny.write_frames(tmp_path / "clip", 3, *size, seed=2)
    ex, _ = _load(tmp_path, tok, vision, {"type": "video", "video": "clip"})
    assert len(ex.input_ids) > 20 and "seconds>" in tok.decode(ex.input_ids)


def test_a_frame_past_the_aspect_edge_is_one_line(tmp_path, tok, vision):
    vl_tiny.write_frames(tmp_path / "clip", 3, 601, 3, seed=3)
    with pytest.raises(DataError, match=r"frame 0: image '.*' is 601x3, a side more than 200 times the other"):
        _load(tmp_path, tok, vision, {"type": "video", "video": "clip"})
