"""`hybridtune data` on a vision-language checkpoint: the rows' images and videos read through its processor as
training reads them (it refused an image part as text-only data before), each image's visual tokens shown as one
token and its count, and the packing of training's own preparation; a text checkpoint still loads no processor."""

from __future__ import annotations

import vl_tiny
from vl_tiny import chat

from hybridtune.cli import main


def test_data_shows_images_and_videos_as_training_reads_them(tmp_path, capsys):
    ckpt = vl_tiny.make_checkpoint(tmp_path / "ckpt")
    vl_tiny.write_image(tmp_path / "a.png", 23, 37, seed=1)
    vl_tiny.write_frames(tmp_path / "clip", 4, 23, 37, seed=2)
    rows = [
        chat("Colour? ", {"type": "image", "image": "a.png"}, answer="Red."),
        chat({"type": "video", "video": "clip", "fps": 2}, "What moves?", answer="A box."),
    ]
    data = vl_tiny.write_rows(tmp_path / "d.jsonl", rows)
    assert main(["data", "--base_model", str(ckpt), "--dataset", str(data), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    image = [line for line in out.splitlines() if "<|image_pad|>" in line]
    video = [line for line in out.splitlines() if "<|video_pad|>" in line]
    assert len(image) == 1 and " x" in image[0] and "<|image_pad|><|image_pad|>" not in image[0], out
    count = int(image[0].split("<|image_pad|> x")[1].split("<")[0])
    assert count > 1  # the processor's grid: (h/patch)(w/patch)/merge^2 of the resized picture
    assert len(video) == 1 and video[0].count("<|video_pad|> x") == 2  # two temporal groups of 2 frames each
    assert video[0].count(" seconds>") == 2 and "<|video_pad|><|video_pad|>" not in video[0]  # with their times
    assert "[[Red.<|im_end|>]]" in out and "[[A box.<|im_end|>]]" in out
    assert "packing: 2 training examples" in out
