"""Hostile or careless frames and images (data/video.py, data/images.py): a video whose frames are each under PIL's
decompression-bomb guard but together a bomb, frames of mixed sizes, an image whose aspect ratio Qwen's processors
refuse, FIFOs and links in a video folder. Each is one DataError naming the row and the part (exit 2), checked from
the headers before any frame is decoded; nothing hangs."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from hybridtune.data import video
from hybridtune.data.images import MAX_ASPECT, load_image
from hybridtune.data.video import load_frames, video_key
from hybridtune.errors import DataError


def _png(path, w, h, colour=0):
    Image.new("RGB", (w, h), (colour, colour, colour)).save(path)
    return str(path)


def _key(frames):
    return video.VIDEO_KEY + __import__("json").dumps({"frames": [str(f) for f in frames], "fps": 2.0})


@pytest.fixture()
def no_decoding(monkeypatch):
    """load_image fails the test: what is checked must be refused from the headers alone."""

    def decoded(*a, **k):
        raise AssertionError("a frame was decoded before the video was checked")

    monkeypatch.setattr(video, "load_image", decoded)


def test_many_frames_each_under_the_guard_are_refused_together_before_decoding(tmp_path, monkeypatch, no_decoding):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)  # each 90x90 frame (8100 pixels) passes PIL alone
    first = _png(tmp_path / "0.png", 90, 90)
    frames = [first] + [str(tmp_path / f"{k}.png") for k in range(1, 5)]
    for f in frames[1:]:
        os.link(first, f)  # a few bytes on disk, 5 x 8100 pixels decoded
    with pytest.raises(DataError) as e:
        load_frames(_key(frames), "d.jsonl:3", "content part 0 (video)", 2)
    msg = str(e.value)
    assert msg.startswith("d.jsonl:3: content part 0 (video): the video's 5 frames of 90x90 are 40500 pixels"), msg
    assert "40000" in msg and "\n" not in msg


def test_a_video_within_the_budget_decodes(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10_000)
    frames = [_png(tmp_path / f"{k}.png", 90, 90, k) for k in range(4)]  # 32400 pixels <= 40000
    images = load_frames(_key(frames), "d.jsonl:1", "part", 2)
    assert [im.getpixel((0, 0)) for im in images] == [(k, k, k) for k in range(4)]


def test_mixed_sizes_are_refused_from_the_headers(tmp_path, no_decoding):
    frames = [_png(tmp_path / "0.png", 23, 37), _png(tmp_path / "1.png", 23, 37), _png(tmp_path / "2.png", 40, 40)]
    with pytest.raises(DataError, match=r"^d.jsonl:1: part: frame 2 \('.*2.png'\) is 40x40 but frame 0 is 23x37"):
        load_frames(_key(frames), "d.jsonl:1", "part", 2)


@pytest.mark.parametrize("size", [(4000, 1), (1, 201 * 3), (MAX_ASPECT * 2 + 1, 2)])
def test_an_image_beyond_the_processors_aspect_ratio_is_one_line(tmp_path, size):
    """transformers' smart_resize raises a ValueError (a traceback) beyond a 200:1 aspect ratio."""
    path = _png(tmp_path / "a.png", *size)
    with pytest.raises(DataError, match=rf"^d.jsonl:2: part: image '.*a.png' is {size[0]}x{size[1]}, a side more"):
        load_image(path, "d.jsonl:2", "part")
    assert load_image(_png(tmp_path / "b.png", MAX_ASPECT, 1), "", "").size == (MAX_ASPECT, 1)  # the bound held


def test_a_fifo_in_a_video_folder_is_refused_unopened_as_one_named_is(tmp_path):
    clip = tmp_path / "clip"
    clip.mkdir()
    for k in range(3):
        _png(clip / f"{k}.png", 23, 37)
    os.mkfifo(clip / "9.png")
    os.symlink(clip / "9.png", clip / "8.png")  # a link to the FIFO too
    with pytest.raises(DataError, match=r"^d:1: p: '.*8\.png' is not a regular file"):  # (listed, never opened)
        video_key({"video": "clip"}, tmp_path, "d:1", "p")
    key = _key([clip / "0.png", clip / "9.png"])
    with pytest.raises(DataError, match=r"^d:1: p, frame 1: image '.*9.png' is not a regular file"):
        load_frames(key, "d:1", "p", 2)


def test_a_frame_linked_to_a_file_that_is_no_image_is_one_line(tmp_path):
    frames = [_png(tmp_path / "0.png", 23, 37), str(tmp_path / "1.png")]
    (tmp_path / "secret.txt").write_text("password=hunter2\n")
    os.symlink(tmp_path / "secret.txt", frames[1])
    with pytest.raises(DataError) as e:
        load_frames(_key(frames), "d:1", "p", 2)
    assert "is not an image PIL can read" in str(e.value) and "hunter2" not in str(e.value)


def test_a_video_of_more_frames_than_qwen_samples_is_one_line_before_any_is_read(tmp_path):
    """A folder of thousands of frames (the red team's 100,000 decoded for minutes) is refused from its listing."""
    from hybridtune.data.video import MAX_VIDEO_FRAMES, video_key
    from hybridtune.errors import DataError

    folder = tmp_path / "clip"
    folder.mkdir()
    for k in range(MAX_VIDEO_FRAMES + 1):
        (folder / f"{k:05d}.png").write_bytes(b"")  # never opened: the count refuses first
    part = {"type": "video", "video": "clip"}
    with pytest.raises(DataError) as e:
        video_key(part, tmp_path, "data.jsonl:3", "message 1, part 2")
    said = str(e.value)
    assert "data.jsonl:3" in said and f"{MAX_VIDEO_FRAMES + 1} frames" in said and "\n" not in said
    (folder / f"{MAX_VIDEO_FRAMES:05d}.png").unlink()
    assert video_key(part, tmp_path, "data.jsonl:3", "message 1, part 2").startswith("video:")
