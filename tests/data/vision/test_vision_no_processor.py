"""A vision-language checkpoint saved without its processor files (issue 46): it was refused even for text-only
data; its text now trains (the processor is needed only for images), and the first image asks for the files in
one line, exit 2."""

from __future__ import annotations

import random

import pytest
import vl_tiny
from vl_tiny import chat

from hybridtune.cli import main
from hybridtune.runtime.vision import IMAGE_PROCESSOR_FILES


@pytest.fixture(scope="module")
def bare(tmp_path_factory):
    """The tiny vision-language checkpoint without its image (and video) processor files."""
    ckpt = vl_tiny.make_checkpoint(tmp_path_factory.mktemp("bare") / "ckpt")
    for name in (*IMAGE_PROCESSOR_FILES, "video_preprocessor_config.json"):
        (ckpt / name).unlink(missing_ok=True)
    return ckpt


def _text_rows(path, n):
    rows = []
    for _ in range(n):
        a, b = random.randint(0, 99), random.randint(0, 99)
        rows.append(chat(f"{a}+{b}=", answer=str(a + b)))
    return vl_tiny.write_rows(path, rows)


def test_text_trains_on_a_checkpoint_without_its_processor_files(bare, tmp_path, capsys):
    data = _text_rows(tmp_path / "d.jsonl", random.randint(5, 9))
    out = tmp_path / "run"
    argv = ["train", "--base_model", str(bare), "--dataset", str(data), "--output_dir", str(out), "--max_steps", "1",
            "--val_set_size", "0", "--eval_steps", "0", "--adapter", "lora"]  # fmt: skip
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err and (out / "final").is_dir()


def test_the_first_image_asks_for_the_processor_files_in_one_line(bare, tmp_path, capsys):
    vl_tiny.write_image(tmp_path / "a.png", random.randint(20, 40), random.randint(20, 40))
    rows = [chat("1+1=", answer="2"), chat("Colour? ", {"type": "image", "image": "a.png"}, answer="Red.")]
    data = vl_tiny.write_rows(tmp_path / "d.jsonl", rows)
    assert main(["data", "--base_model", str(bare), "--dataset", str(data), "--rows", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert "Traceback" not in err and len(lines) == 1, err
    assert f"{bare} is a vision-language checkpoint saved without its processor files" in lines[0]
    assert "copy the processor files of its release beside it" in lines[0]
