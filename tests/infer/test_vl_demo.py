"""The vision-language CPU demo (`python -m hybridtune.infer.vl_demo OUT`): its pictures hold a square of the
answer's colour and a circle of another; its checkpoint opens as a vision-language model through hybridtune's
loader with its own image processor (no torchvision), and `eval` and `generate` run on its data."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from hybridtune.cli import main
from hybridtune.infer import vl_demo


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("vl-demo")
    assert vl_demo.main([str(out), "--train", "6", "--test", "4"]) == 0
    return out


def test_pictures_answer_the_question(demo):
    for split, n in (("train", 6), ("test", 4)):
        rows = [json.loads(x) for x in (demo / "shapes" / f"{split}.jsonl").read_text().splitlines()]
        assert len(rows) == n
        for row in rows:
            user, answer = row["messages"]
            image = user["content"][0]["image"]
            assert user["content"][1]["text"] == vl_demo.QUESTION and answer["content"].endswith(".")
            colour = vl_demo.COLOURS[answer["content"][:-1].lower()]
            pixels = np.asarray(Image.open(demo / "shapes" / image).convert("RGB")).reshape(-1, 3)
            counts = {c: int((pixels == rgb).all(1).sum()) for c, rgb in vl_demo.COLOURS.items()}
            assert int((pixels == colour).all(1).sum()) >= 64  # the square: at least 8 x 8
            assert sum(1 for c in counts.values() if c) == 2  # and a circle of another colour


def test_the_demo_model_is_vision_language(demo, capsys):
    from hybridtune.infer.generate import vision_of
    from hybridtune.infer.load import open_model

    opened = open_model(str(demo / vl_demo.MODEL_DIR))
    vision = vision_of(opened, True)
    assert type(vision.image_processor).__name__ == "Qwen2VLImageProcessorPil" and vision.merge == 2
    capsys.readouterr()
    rc = main(["eval", "--model", str(demo / vl_demo.MODEL_DIR), "--dataset", str(demo / "shapes" / "test.jsonl")])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "exact_match  0.000" in out.out and "visual tokens per image 16 / 16 / 16" in out.err
    image = demo / "shapes" / "img" / "test-0000.png"
    rc = main(["generate", str(demo / vl_demo.MODEL_DIR), "--prompt", vl_demo.QUESTION, "--image", str(image)])
    assert rc == 0, capsys.readouterr().err
