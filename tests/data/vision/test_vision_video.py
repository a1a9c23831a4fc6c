"""Videos as lists of frames (data/video.py): the frames' pixel values and grid as Qwen3.5's video processor gives
them (against its image processor on still frames, and against the processor itself where torchvision is installed),
the video's text as transformers' Qwen3VLProcessor writes it, its M-RoPE positions as `get_rope_index` gives them for
the document alone, and every bad video one line naming file:line and the part."""

from __future__ import annotations

import shutil

import pytest
import torch
import vl_tiny
from vl_tiny import chat

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_source
from hybridtune.data.images import load_image
from hybridtune.data.video import FrameProcessor, timestamps
from hybridtune.data.vision import rope_positions
from hybridtune.errors import DataError


@pytest.fixture()
def data(tmp_path):
    vl_tiny.write_frames(tmp_path / "clip", 5, 23, 37, seed=1)  # 5 frames (odd: the last is repeated), odd size
    (tmp_path / "img").mkdir()
    vl_tiny.write_image(tmp_path / "img" / "a.png", 31, 19, seed=2)
    return tmp_path


def _load(path, tok, vision, rows):
    vl_tiny.write_rows(path, rows)
    return load_source(DatasetConfig(path=str(path)), tok, cache=False, vision=vision)


def _video(ref, fps=None):
    part = {"type": "video", "video": ref}
    return part if fps is None else {**part, "fps": fps}


def test_still_frames_equal_the_image_processor(tmp_path):
    """A video of frames A, A, B, B is two temporal groups, each the image processor's patches of A and of B (an
    image is one frame repeated to the temporal patch): the resize, rescale, normalise and patch layout agree."""
    a = load_image(str(vl_tiny.write_image(tmp_path / "a.png", 23, 37, seed=3)), "", "")
    b = load_image(str(vl_tiny.write_image(tmp_path / "b.png", 23, 37, seed=4)), "", "")
    values, grid = FrameProcessor(vl_tiny.video_processor())([a, a, b, b])
    assert grid.tolist() == [[2, 10, 6]]  # 24x40 pixels, as smart_resize over 4 frames gives
    ip = vl_tiny.image_processor()
    for g, im in enumerate((a, b)):
        out = ip(images=[im], return_tensors="pt")
        assert out["image_grid_thw"].tolist() == [[1, 10, 6]]
        torch.testing.assert_close(values[g * 60 : (g + 1) * 60], out["pixel_values"], rtol=0, atol=1e-6)


def test_frames_equal_transformers_video_processor_with_torchvision(tmp_path):
    pytest.importorskip("torchvision")
    frames = [load_image(str(vl_tiny.write_image(tmp_path / f"{k}.png", 23, 37, seed=k)), "", "") for k in range(5)]
    vp = vl_tiny.video_processor()
    want = vp(videos=[frames], do_sample_frames=False, return_tensors="pt")
    values, grid = FrameProcessor(vp)(frames)
    assert torch.equal(grid, want["video_grid_thw"])
    torch.testing.assert_close(values, want["pixel_values_videos"], rtol=0, atol=0.05)  # PIL vs torchvision resize


def test_a_video_part_is_the_processors_text_and_get_rope_index_positions(data, tok, vision):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    frames = sorted(str(p) for p in (data / "clip").iterdir())
    rows = [
        chat("Look: ", _video("clip", 4), " then ", {"type": "image", "image": "img/a.png"}, "?"),
        chat(_video([f"clip/{p.rsplit('/', 1)[1]}" for p in frames[:4]])),  # a list of frames, the default fps 2
    ]
    ex = _load(data / "d.jsonl", tok, vision, rows).examples
    model, _ = vl_tiny.build_model()
    for e, n, fps in zip(ex, (5, 4), (4.0, 2.0)):
        vids = [r for r in e.images if r.group >= 0]
        assert [r.group for r in vids] == list(range((n + 1) // 2)) and all(r.grid == (1, 10, 6) for r in vids)
        assert not any(any(e.loss_mask[r.offset : r.offset + r.tokens]) for r in e.images)
        # the text transformers' processor writes for this video, inside the template's vision start/end
        proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
        proc.video_processor, proc.video_token = vl_tiny.video_processor(), "<|video_pad|>"
        proc.vision_start_token, proc.vision_end_token = "<|vision_start|>", "<|vision_end|>"
        meta = VideoMetadata(total_num_frames=n, fps=fps, frames_indices=list(range(n)))
        grid = torch.tensor([[(n + 1) // 2, 10, 6]])
        text = "<|vision_start|>" + proc.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
        want = tok.encode(text + "<|vision_end|>", add_special_tokens=False)
        start = vids[0].offset - len(tok.encode(text.split("<|video_pad|>")[0], add_special_tokens=False))
        assert e.input_ids[start : start + len(want)] == want
        # positions: get_rope_index of this document alone, the video as the processor hands it (one grid row)
        ids = torch.tensor([e.input_ids])
        types = (ids == vision.image_token_id).int() + 2 * (ids == vision.video_token_id).int()
        images = [r.grid for r in e.images if r.group < 0]
        want_pos, _ = model.model.get_rope_index(
            ids, types, torch.tensor(images) if images else None, video_grid_thw=grid.clone()
        )
        assert torch.equal(rope_positions(len(e), e.images, vision.merge), want_pos[:, 0])
    assert timestamps(5, 4.0, 2) == [0.125, 0.625, 1.0]  # (frames 0-1, 2-3, 4-4 at 4 fps)


BAD = {
    "missing frame": (["clip/frame-000.png", "clip/nope.png"], "frame 1: image file", "does not exist"),
    "truncated frame": (["clip/frame-000.png", "cut.png"], "frame 1: image", "is truncated or damaged"),
    "sizes differ": (["clip/frame-000.png", "img/a.png"], "frame 1 (", "must share one size"),
    "one frame": (["clip/frame-000.png"], "", "needs at least 2 frames"),
    "empty folder": ("empty", "", "holds no image files"),
    "not a folder": ("img/a.png", "", "is not a folder of frames"),
    "no frames": (None, "", "names no frames"),
    "bad fps": ("clip", "", "fps must be a positive number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_video_is_one_line_naming_file_line_and_part(data, tok, vision, case):
    good = (data / "clip" / "frame-001.png").read_bytes()
    (data / "cut.png").write_bytes(good[: len(good) // 2])
    (data / "empty").mkdir()
    ref, where, said = BAD[case]
    part = _video(ref, -1 if case == "bad fps" else None)
    path = data / "d.jsonl"
    with pytest.raises(DataError) as e:
        _load(path, tok, vision, [chat("fine"), chat("Look: ", part)])
    msg = str(e.value)
    assert msg.startswith(f"{path}:2: message 0 (role 'user'), key 'content', content part 1 (video)"), msg
    assert where in msg and said in msg and "\n" not in msg


def test_a_checkpoint_without_a_video_processor_refuses_videos(data, tok, tmp_path):
    from hybridtune.runtime.vision import vision_for

    ckpt = vl_tiny.make_checkpoint(tmp_path / "ckpt")
    (ckpt / "video_preprocessor_config.json").unlink()
    vision = vision_for(ckpt, tok)
    with pytest.raises(DataError, match=r"d.jsonl:1: .*content part 0 \(video\): the checkpoint has no video proc"):
        _load(data / "d.jsonl", tok, vision, [chat(_video("clip"))])
    shutil.rmtree(ckpt)


def test_the_cache_key_follows_the_frames(data, tok, vision, tmp_path):
    from hybridtune.data.vision import media_digest

    row = chat(_video("clip"))
    first = media_digest([(row, data)], vision)
    assert media_digest([(row, data)], vision) == first
    vl_tiny.write_image(data / "clip" / "frame-002.png", 23, 37, seed=99)
    assert media_digest([(row, data)], vision) != first
