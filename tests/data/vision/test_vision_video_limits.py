"""A video's rate and the thinnest pictures, past what tests/security/test_video_edges.py holds (the rate's range in
the data and in --video, the thin frames' tokens): a rate no float holds (a JSON integer of 400 digits was an
OverflowError traceback, through `hybridtune data` too), --fps of generate and chat refused before the model loads,
a prompts file's video part that holds a `video:` key refused (it skipped the rate's check, and a malformed one was
a traceback after the model loaded), the times written over the whole range; image parts at the 200:1 edge and of
1-3 pixels processed and the vision tower run over them and over such frames, 601x3 one line; and the video
processor's own refusal of frames `load_image` lets through (its resize rounds a thin side up, truncating) one line
naming the row and the part."""

from __future__ import annotations

import json
import math

import pytest
import torch
import vl_tiny
from vl_tiny import chat

from hybridtune.cli import main
from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_source
from hybridtune.data.video import FPS_RANGE, MAX_VIDEO_FRAMES, FrameProcessor, Frames, _Loaded, timestamps
from hybridtune.data.vision import Vision
from hybridtune.errors import DataError

HUGE = "1" + "0" * 400  # a JSON integer: json.loads keeps it exact, float() of it overflows


@pytest.fixture(scope="module")
def tower(tok):
    """The tiny checkpoint's vision tower alone (random weights)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    torch.manual_seed(0)
    return Qwen3_5VisionModel._from_config(vl_tiny.config(tok).vision_config).float().eval()


def _load(tmp_path, tok, vision, *parts, raw_fps: str | None = None):
    """The first example of a one-row data file of `parts`; `raw_fps` replaces the video part's `"fps": 1` as written."""
    path = tmp_path / "d.jsonl"
    line = json.dumps(chat(*parts, "what", answer="x"))
    path.write_text((line.replace('"fps": 1', f'"fps": {raw_fps}') if raw_fps else line) + "\n")
    return load_source(DatasetConfig(path=str(path)), tok, cache=False, vision=vision).examples[0]


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("raw", [HUGE, "-" + HUGE, "1e-330", '"2"', "null", "true", "1e400"])
def test_a_rate_no_float_holds_is_one_line(tmp_path, tok, vision, raw):
    vl_tiny.write_frames(tmp_path / "clip", 2, 9, 7, seed=1)
    with pytest.raises(DataError) as e:
        _load(tmp_path, tok, vision, {"type": "video", "video": "clip", "fps": 1}, raw_fps=raw)
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}:1: ") and "content part 0 (video): fps " in msg, msg
    assert "\n" not in msg and len(msg) < 400  # (the 400 digits are not in it: ~1e400)
    if raw == HUGE:
        assert "fps ~1e400 is outside" in msg


def test_hybridtune_data_refuses_the_huge_rate_in_one_line(tmp_path, tok, capsys):
    ckpt = tmp_path / "ckpt"  # (what `data` reads of a checkpoint: its config, tokenizer and processors)
    vl_tiny.config(tok).save_pretrained(str(ckpt))
    tok.save_pretrained(str(ckpt))
    vl_tiny.image_processor().save_pretrained(str(ckpt))
    vl_tiny.video_processor().save_pretrained(str(ckpt))
    vl_tiny.write_frames(tmp_path / "clip", 2, 9, 7, seed=1)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat({"type": "video", "video": "clip", "fps": 1}, "what")).replace("1}", HUGE + "}"))
    assert main(["data", "--base_model", str(ckpt), "--dataset", str(data), "--rows", "1"]) == 2
    assert f"{data}:1: " in _one_line(capsys)


@pytest.mark.parametrize("fps", ["5e-324", "1e-300", "1e-9", "1e9", "1e300", "1e400", "nan", "0", "-2"])
def test_generate_and_chat_refuse_fps_before_the_model_loads(tmp_path, monkeypatch, capsys, fps):
    vl_tiny.write_frames(tmp_path / "clip", 2, 9, 7, seed=1)
    monkeypatch.chdir(tmp_path)
    absent = str(tmp_path / "no-model")  # (nothing loads: the video is checked first)
    assert main(["generate", absent, "--prompt", "hi", "--video", "clip", "--fps", fps]) == 2
    assert "--video 1: the video: fps " in _one_line(capsys)
    assert main(["chat", absent, "--video", "clip", "--fps", fps]) == 2
    assert "--video 1: the video: fps " in _one_line(capsys)


@pytest.mark.parametrize("key", ["good frames, fps 1e-300", "video:nonsense", "video:{}"])
def test_a_prompts_file_video_key_is_checked_as_any_part(tmp_path, capsys, key):
    clip = vl_tiny.write_frames(tmp_path / "clip", 2, 9, 7, seed=1)
    if key.startswith("good"):
        key = "video:" + json.dumps({"frames": [str(p) for p in sorted(clip.iterdir())], "fps": 1e-300})
    part = {"type": "video", "video": key}
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        json.dumps({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]}) + "\n"
    )
    assert main(["generate", str(tmp_path / "no-model"), "--prompts", str(prompts)]) == 2
    line = _one_line(capsys)
    assert f"{prompts}:1: message 0 of 'messages', content part 0: video '" in line and "is not a folder" in line


def test_the_times_stay_short_over_the_whole_range():
    for fps in FPS_RANGE:
        times = timestamps(MAX_VIDEO_FRAMES, fps, 2)
        text = [f"{t:.1f}" for t in times]
        assert len(times) == MAX_VIDEO_FRAMES // 2 and all(math.isfinite(t) for t in times)
        assert max(len(s) for s in text) <= 9 and times == sorted(times)  # at most '2763000.0' (768 h), in order
    assert len(set(f"{t:.1f}" for t in timestamps(MAX_VIDEO_FRAMES, FPS_RANGE[0], 2))) == MAX_VIDEO_FRAMES // 2


@pytest.mark.parametrize("size", [(600, 3), (3, 600), (1, 1), (2, 2), (3, 3)])
def test_thin_images_and_frames_run_through_the_tower(tmp_path, tok, vision, tower, size):
    vl_tiny.write_image(tmp_path / "thin.png", *size, seed=4)
    vl_tiny.write_frames(tmp_path / "clip", 3, *size, seed=5)
    ex = _load(tmp_path, tok, vision, {"type": "image", "image": "thin.png"}, {"type": "video", "video": "clip"})
    assert [r.group for r in ex.images] == [-1, 0, 1]  # the image, then 3 frames padded to 2 temporal groups
    values, grid = vision.pixels(ex.images)
    with torch.no_grad():
        out = tower(values, grid_thw=grid).pooler_output
    assert out.shape[0] == sum(r.tokens for r in ex.images) and torch.isfinite(out).all()
    thin = min(size) == 3 and max(size) == 600
    assert not thin or max(ex.images[0].grid[1:]) > 10 * min(ex.images[0].grid[1:])  # (kept thin, not squared)


@pytest.mark.parametrize("size", [(601, 3), (3, 601)])
def test_an_image_past_the_aspect_edge_is_one_line(tmp_path, tok, vision, capsys, monkeypatch, size):
    vl_tiny.write_image(tmp_path / "thin.png", *size)
    with pytest.raises(DataError) as e:
        _load(tmp_path, tok, vision, {"type": "image", "image": "thin.png"})
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}:1: ") and "content part 0 (image): image '" in msg
    assert f"is {size[0]}x{size[1]}, a side more than 200 times the other" in msg and "\n" not in msg
    monkeypatch.chdir(tmp_path)
    assert main(["generate", str(tmp_path / "no-model"), "--prompt", "hi", "--image", "thin.png"]) == 2
    assert "--image 1" in _one_line(capsys)


def test_the_video_processors_own_refusal_is_one_line(tmp_path, tok):
    """Patch 5 and merge 3: frames of 2090x11 (190:1, which `load_image` takes) are 2850x14 in smart_resize's first
    scaling (203.6:1), a ValueError there."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    odd = Qwen3VLVideoProcessor(
        patch_size=5, merge_size=3, temporal_patch_size=2, size={"shortest_edge": 16, "longest_edge": 10**7}
    )
    start, end, image, video = tok.convert_tokens_to_ids(vl_tiny.VISION_TOKENS)
    vision = Vision(vl_tiny.image_processor(), tok, image, start, end, video_id=video, video=FrameProcessor(odd))
    vl_tiny.write_frames(tmp_path / "clip", 2, 2090, 11, seed=6)
    with pytest.raises(DataError) as e:
        _load(tmp_path, tok, vision, {"type": "video", "video": "clip"})
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'd.jsonl'}:1: ") and "content part 0 (video): the checkpoint's video" in msg
    assert "refuses the video's 2 frames of 2090x11 (absolute aspect ratio" in msg and "\n" not in msg


def test_a_loaded_processors_refusal_names_the_part():
    """With torchvision the checkpoint's own video processor runs (`_Loaded`): its ValueError is the same line."""
    from PIL import Image

    class Refusing:
        temporal_patch_size = 2

        def __call__(self, **kwargs):
            raise ValueError("absolute aspect ratio must be smaller than 200, got 203.57")

    frames = Frames([Image.new("RGB", (2090, 11))] * 2)
    frames.where, frames.what = "d.jsonl:4", "content part 1 (video)"
    with pytest.raises(DataError, match=r"^d\.jsonl:4: content part 1 \(video\): the checkpoint's video processor "):
        _Loaded(Refusing())(frames)
