"""`hybridtune train` on a tiny vision-language checkpoint (built here, with its image processor) and chat rows with
images, on the CPU: it trains (LoRA, packed, the loss finite and logged), keeps the vision tower frozen, and a bad
image stops it before the model loads with one line naming file:line and the part, exit 2."""

from __future__ import annotations

import json

import pytest
import vl_tiny
from vl_tiny import chat

from hybridtune.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return vl_tiny.make_checkpoint(tmp_path_factory.mktemp("vl") / "ckpt")


def _data(d, bad: str | None = None):
    (d / "img").mkdir(exist_ok=True)
    for k, (w, h) in enumerate([(23, 37), (50, 17), (31, 31), (40, 29)]):
        vl_tiny.write_image(d / "img" / f"{k}.png", w, h, seed=k)
    colours = ["Red.", "Green.", "Blue.", "Grey."]
    rows = [chat("What colour is this? ", {"type": "image", "image": f"img/{k % 4}.png"}, answer=colours[k % 4])
            for k in range(12)]  # fmt: skip
    rows += [
        chat("Two: ", {"type": "image", "image": "img/0.png"}, {"type": "image", "image": "img/3.png"}),
        chat("Hi"),
    ]
    if bad is not None:
        rows.insert(5, chat("Look: ", {"type": "image_url", "image_url": {"url": bad}}))
    return vl_tiny.write_rows(d / "data.jsonl", rows)


def _train(ckpt, data, out, *extra):
    args = ["train", "--base_model", str(ckpt), "--dataset", str(data), "--output_dir", str(out)]
    args += ["--adapter", "lora", "--sequence_len", "256", "--max_steps", "3", "--logging_steps", "1"]
    return main(args + ["--val_set_size", "2", "--eval_steps", "0", "--warmup_steps", "0", *extra])


def test_train_on_images_end_to_end(ckpt, tmp_path, capsys, monkeypatch):
    import hybridtune.runtime.step as step

    seen = []  # the images of every forward that ran the vision tower

    def spy(model, kwargs):
        seen.append(len(kwargs["image_grid_thw"]) if "image_grid_thw" in kwargs else 0)
        return embeds(model, kwargs)

    embeds = step.image_embeds
    monkeypatch.setattr(step, "image_embeds", spy)
    monkeypatch.setattr("hybridtune.train.samples._warned", set())  # (said once per process: not for later tests)
    rc = _train(ckpt, _data(tmp_path), tmp_path / "run", "--max_pixels", "1024", "--eval_samples", "1")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "eval_samples: held-out examples with images are passed over" in err  # (not generated without them)
    assert sum(seen) >= 3 * 6  # three steps of at least six images each (a bin of 256 tokens holds them)
    assert "visual tokens per image" in err and "vision: Qwen2VLImageProcessorPil" in err
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["type"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3] and all(0 < r["loss"] < 20 for r in train)
    assert any(r["type"] == "eval" for r in recs)
    assert (tmp_path / "run" / "final" / "adapter_model.safetensors").is_file()
    saved = (tmp_path / "run" / "final" / "adapter_config.json").read_text()
    assert "visual" not in saved  # the adapter is on the text model only


def test_a_bad_image_stops_train_in_one_line(ckpt, tmp_path, capsys):
    data = _data(tmp_path, bad="img/missing.png")
    rc = _train(ckpt, data, tmp_path / "run")
    err = capsys.readouterr().err
    assert rc == 2
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err
    assert f"{data}:6: message 0 (role 'user'), key 'content', content part 1 (image_url): image file" in lines[0]
    assert "missing.png' does not exist" in lines[0]
