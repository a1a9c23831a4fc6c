"""Inference as trained (issue 46, slow tier): a LoRA trained by `hybridtune train` on coloured squares (a 32x32
picture of one of four colours; "Which colour is the square?") over the CPU demo's tiny vision-language checkpoint
names the colour of 20 fresh pictures, and `generate` (on them, asked that and an open question), `chat --image`
and `generate --video` answer token
for token what stock transformers + peft answer when called with every input the checkpoint's processor returns
(stock_vl.py); every input `generate` hands the model is the processor's, `mm_token_type_ids` too, and this model's
logits move without it (the images at text positions, as hybridtune's generation gave them before issue 46). Its
greedy tokens seldom do (a tiny model sure of a colour): tests/data/vision/test_vision_model_inputs.py is the fast
check that the input is never dropped.

The demo checkpoint's random tied embeddings are scaled up first: at their initial scale the head's logits stay
near uniform, which a LoRA cannot undo, and it would learn nothing to answer with."""

from __future__ import annotations

import io
import json
import random
import sys

import pytest
import stock_vl
import torch
import vl_tiny
from PIL import Image

import hybridtune.runtime.generation as generation
from hybridtune.cli import main
from hybridtune.infer import vl_demo

pytestmark = pytest.mark.slow

N_TEST = 20
NEW = 12
OPEN = "Describe the picture."  # a question it never trained on: its long answers show where positions differ


def _picture(path, colour: str, rng: random.Random):
    """A square of `colour` with a little noise on every pixel (a fresh picture each time)."""
    r, g, b = vl_demo.COLOURS[colour]
    im = Image.new("RGB", (vl_demo.SIZE, vl_demo.SIZE), (r, g, b))
    im.putdata([tuple(min(255, max(0, v + rng.randint(-12, 12))) for v in (r, g, b)) for _ in range(vl_demo.SIZE**2)])
    im.save(path)
    return path


def _row(name: str, colour: str | None = None, question: str = vl_demo.QUESTION) -> dict:
    user = {"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": question}]}
    return {"messages": [user] + ([{"role": "assistant", "content": colour.capitalize() + "."}] if colour else [])}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import Qwen3_5ForConditionalGeneration

    root = tmp_path_factory.mktemp("as-trained")
    ckpt = vl_demo.write_model(root / "model", seed=random.randrange(10**6))
    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(25)  # (see the module docstring)
    model.save_pretrained(str(ckpt))
    rng = random.Random()
    (root / "img").mkdir()
    colours = sorted(vl_demo.COLOURS)
    train = [rng.choice(colours) for _ in range(128)]
    rows = []
    for k, c in enumerate(train):
        _picture(root / f"img/train-{k}.png", c, rng)
        rows.append(_row(f"img/train-{k}.png", c))
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    test = [colours[k % 4] for k in range(N_TEST)]
    rng.shuffle(test)
    for k, c in enumerate(test):
        _picture(root / f"img/test-{k}.png", c, rng)
    prompts = [_row(f"img/test-{k}.png", question=q) for q in (vl_demo.QUESTION, OPEN) for k in range(N_TEST)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    out = root / "run"
    args = ["train", "--base_model", str(ckpt), "--dataset", str(root / "train.jsonl"), "--adapter", "lora"]
    args += ["--learning_rate", "5e-3", "--num_epochs", "6", "--sequence_len", "256", "--val_set_size", "0"]
    assert main(args + ["--eval_steps", "0", "--lora_dropout", "0", "--output_dir", str(out)]) == 0
    return root, ckpt, out, test


@pytest.fixture(scope="module")
def stock(run):
    """Stock transformers + peft: the base with the run's adapter, and the checkpoint's processor."""
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    _, ckpt, out, _ = run
    base = Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).float().eval()
    return PeftModel.from_pretrained(base, str(out / "final")).eval(), stock_vl.processor(ckpt)


def _spy(monkeypatch) -> list:
    """The new token ids of every completion generation makes, in order."""
    return vl_tiny.spy_completions(monkeypatch, generation)


def _stock_image(stock, image, question: str = vl_demo.QUESTION) -> list[int]:
    model, proc = stock
    return stock_vl.greedy(model, proc, _inputs(proc, image, question), NEW)


def test_generate_equals_stock_with_the_processors_inputs_on_20_pictures(run, stock, monkeypatch, capsys):
    from transformers import Qwen3_5ForConditionalGeneration as Model

    root, _, out, colours = run
    seen = _spy(monkeypatch)
    given: list[dict] = []  # what each generate() call of hybridtune's got
    real = Model.generate
    monkeypatch.setattr(Model, "generate", lambda self, *a, **k: given.append(k) or real(self, *a, **k))
    capsys.readouterr()
    rc = main(["generate", str(out), "--prompts", str(root / "prompts.jsonl"), "--batch_size", str(N_TEST), "--json",
               "--max_new_tokens", str(NEW)])  # fmt: skip
    done = json.loads(capsys.readouterr().out)
    assert rc == 0 and len(seen) == 2 * N_TEST
    monkeypatch.setattr(Model, "generate", real)
    asked = [(root / f"img/test-{k}.png", q) for q in (vl_demo.QUESTION, OPEN) for k in range(N_TEST)]
    assert seen == [_stock_image(stock, im, question=q) for im, q in asked]
    said = [d["completion"].strip().lower() for d in done[:N_TEST]]
    right = sum(s.startswith(c) for s, c in zip(said, colours))
    assert right >= N_TEST // 2, list(zip(said, colours))  # the LoRA reads the colours (a guess: 1 in 4)
    # every input the processor returns was given (one question a batch: no padding), mm_token_type_ids too
    model, proc = stock
    want = [_inputs(proc, im, q) for im, q in asked]
    assert len(given) == 2 and all("mm_token_type_ids" in k for k in given)
    for call, rows in zip(given, (want[:N_TEST], want[N_TEST:])):
        for key in ("input_ids", "mm_token_type_ids", "image_grid_thw", "pixel_values"):
            assert torch.equal(call[key].to(rows[0][key].dtype), torch.cat([w[key] for w in rows])), key
    # and this model reads the positions it gives: without it (the images at text positions) its logits move
    for w in want[:N_TEST]:
        moved = stock_vl.first_logits(model, w) - stock_vl.first_logits(model, w, ("mm_token_type_ids",))
        assert moved.abs().max() > 1e-3


def _inputs(proc, image, question: str) -> dict:
    text = stock_vl.prompt(proc, [{"role": "user", "content": stock_vl.IMAGE + question}])
    return stock_vl.image_inputs(proc, text, [image])


def test_chat_equals_stock_with_the_processors_inputs(run, stock, monkeypatch, capsys):
    root, _, out, _ = run
    monkeypatch.chdir(root)
    import hybridtune.infer.chat as chat_command

    real = chat_command.complete
    seen: list = []
    monkeypatch.setattr(chat_command, "complete", lambda *a, **kw: seen.extend(real(*a, **kw)) or seen[-1:])
    for k in random.sample(range(N_TEST), 3):
        seen.clear()
        monkeypatch.setattr(sys, "stdin", io.StringIO(vl_demo.QUESTION + "\n"))
        rc = main(["chat", str(out), "--image", f"img/test-{k}.png", "--max_new_tokens", str(NEW)])
        assert rc == 0, capsys.readouterr().err
        assert [ids for ids, _ in seen] == [_stock_image(stock, root / f"img/test-{k}.png")]


def test_a_video_prompt_equals_stock_with_the_processors_inputs(run, stock, monkeypatch, capsys):
    root, _, out, colours = run
    model, proc = stock
    rng = random.Random()
    clip = root / "clip"
    clip.mkdir(exist_ok=True)
    colour = rng.choice(sorted(vl_demo.COLOURS))
    for k in range(rng.choice([2, 3, 4])):
        _picture(clip / f"frame-{k}.png", colour, rng)
    seen = _spy(monkeypatch)
    rc = main(["generate", str(out), "--prompt", vl_demo.QUESTION, "--video", str(clip), "--max_new_tokens", str(NEW)])
    assert rc == 0, capsys.readouterr().err
    text = stock_vl.prompt(proc, [{"role": "user", "content": stock_vl.VIDEO + vl_demo.QUESTION}])
    inputs = stock_vl.video_inputs(proc, text, clip, 2.0)
    assert seen == [stock_vl.greedy(model, proc, inputs, NEW)]
