"""`hybridtune eval` on image data: the held-out split of a vision-language run (chat rows with images), read through
the checkpoint's image processor and packed with the images as training packs them, gives the run's own logged
eval (loss and exact match); `--split all` on a data file with images evaluates every row."""

from __future__ import annotations

import json

import pytest
import vl_tiny
from vl_tiny import chat

from hybridtune.cli import main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl-eval")
    ckpt = vl_tiny.make_checkpoint(d / "ckpt")
    (d / "img").mkdir()
    for k, (w, h) in enumerate([(23, 37), (50, 17), (31, 31)]):
        vl_tiny.write_image(d / "img" / f"{k}.png", w, h, seed=k)
    colours = ["Red.", "Green.", "Blue."]
    rows = [chat("Colour? ", {"type": "image", "image": f"img/{k % 3}.png"}, answer=colours[k % 3]) for k in range(15)]
    data = vl_tiny.write_rows(d / "data.jsonl", rows)
    out = d / "run"
    args = ["train", "--base_model", str(ckpt), "--dataset", str(data), "--output_dir", str(out), "--adapter", "lora"]
    args += ["--sequence_len", "256", "--max_steps", "3", "--val_set_size", "5", "--eval_steps", "0"]
    assert main(args + ["--warmup_steps", "0", "--learning_rate", "0.01"]) == 0
    return out, data


def _eval(capsys, *args) -> dict:
    rc = main(["eval", *args, "--json", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out)


def test_eval_heldout_images_equals_the_runs_logged_eval(run, capsys):
    out, _ = run
    capsys.readouterr()
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in logged if r["type"] == "eval"][-1]
    res = _eval(capsys, "--model", str(out), "--split", "heldout")
    assert res["eval_examples"] == 5 and res["formats"] == ["chat"]
    assert res["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-5)
    assert res["exact_match"] == pytest.approx(last["exact_match"])
    assert res["tokens"] > 5 * 20  # the visual tokens are in the packs (a text-only row here is ~20 tokens)


def test_eval_all_on_a_file_with_images(run, capsys):
    out, data = run
    capsys.readouterr()
    res = _eval(capsys, "--model", str(out / "final"), "--dataset", str(data))
    assert res["eval_examples"] == 15 and 0 < res["eval_loss"] < 20 and res["exact_match"] is not None
