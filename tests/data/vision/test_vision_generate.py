"""`hybridtune generate` with images on a tiny vision-language checkpoint (random weights spread wide enough that
greedy decoding says something, and says something else for another image): token for token what stock
transformers generates from the same prompt (the image processor, the image token widened to the image's visual
tokens as the checkpoint's processor does, `generate` with pixel_values and image_grid_thw), for the full model and
for a LoRA adapter trained on it (transformers + peft); images from --image and from a prompts file's image parts;
a bad image or a text-only model given one is one line, exit 2."""

from __future__ import annotations

import json

import pytest
import stock_vl
import torch
import vl_tiny
from vl_tiny import chat

import hybridtune.runtime.generation as generation
from hybridtune.cli import main

PROMPT = "What colour is this?"
NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny VL checkpoint whose random weights are widened (+ N(0, 0.1) on every matrix)."""
    model, tok = vl_tiny.build_model(0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    d = tmp_path_factory.mktemp("vl-gen") / "ckpt"
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    vl_tiny.image_processor().save_pretrained(str(d))
    for k, (w, h) in enumerate([(23, 37), (50, 17)]):
        vl_tiny.write_image(d.parent / f"{k}.png", w, h, seed=k)
    return d


PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def stock(model, directory, images, text=PROMPT, messages=None) -> list[int]:
    """Greedy new tokens of stock transformers: the checkpoint's processor called on the tokenizer's template of the
    prompt and the images, every input it returns given to `model.generate` (stock_vl.py), cut after the first
    end-of-turn id. `messages`: the conversation (contents with PLACEHOLDER for each image), else one user turn:
    images, `text`."""
    proc = stock_vl.processor(directory)
    messages = messages or [{"role": "user", "content": PLACEHOLDER * len(images) + text}]
    return stock_vl.greedy(model, proc, stock_vl.image_inputs(proc, stock_vl.prompt(proc, messages), images), NEW)


def ours(monkeypatch, capsys, args) -> tuple[list[list[int]], list[dict]]:
    """The new token ids of each prompt of `hybridtune generate ARGS --json`, and its JSON."""
    seen = vl_tiny.spy_completions(monkeypatch, generation)
    rc = main(["generate", *args, "--max_new_tokens", str(NEW), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return seen, json.loads(out.out)


def test_generate_with_an_image_equals_stock_transformers(ckpt, monkeypatch, capsys):
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).float().eval()
    img0, img1 = ckpt.parent / "0.png", ckpt.parent / "1.png"
    monkeypatch.chdir(ckpt.parent)  # --image paths are relative to the working directory
    for images in ([img0], [img1], [img0, img1]):
        ids, done = ours(
            monkeypatch, capsys, [str(ckpt), "--prompt", PROMPT, *sum((["--image", p.name] for p in images), [])]
        )
        assert ids == [stock(model, ckpt, images)]
        assert done[0]["new_tokens"] == len(ids[0])
    # the image is read: another image, or none, is another answer
    assert stock(model, ckpt, [img0]) != stock(model, ckpt, [img1])
    assert stock(model, ckpt, [img0]) != stock(model, ckpt, [])


def test_prompts_file_image_parts_are_relative_to_the_file(ckpt, tmp_path, monkeypatch, capsys):
    from transformers import Qwen3_5ForConditionalGeneration

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).float().eval()
    rows = [
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "1.png"}, {"type": "text", "text": PROMPT}]}]},
        {"prompt": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "0.png"}}, {"type": "text", "text": PROMPT}]}]},
    ]  # fmt: skip
    prompts = ckpt.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)  # elsewhere: the paths are the file's
    ids, _ = ours(monkeypatch, capsys, [str(ckpt), "--prompts", str(prompts), "--batch_size", "1"])
    assert ids == [stock(model, ckpt, [ckpt.parent / "1.png"]), stock(model, ckpt, [ckpt.parent / "0.png"])]


def test_generate_on_a_lora_adapter_equals_transformers_and_peft(ckpt, tmp_path, monkeypatch, capsys):
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    data = vl_tiny.write_rows(
        tmp_path / "data.jsonl",
        [chat("Colour? ", {"type": "image", "image": str(ckpt.parent / f"{k % 2}.png")}, answer=["Red.", "Blue."][k % 2])
         for k in range(8)],
    )  # fmt: skip
    out = tmp_path / "run"
    args = ["train", "--base_model", str(ckpt), "--dataset", str(data), "--output_dir", str(out), "--adapter", "lora"]
    args += ["--sequence_len", "256", "--max_steps", "4", "--learning_rate", "0.01", "--val_set_size", "0"]
    args += ["--image_roots", str(ckpt.parent)]  # (the images lie beside the checkpoint, not the data file)
    assert main(args + ["--eval_steps", "0", "--warmup_steps", "0"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    img = ckpt.parent / "0.png"
    ids, _ = ours(monkeypatch, capsys, [str(out), "--prompt", PROMPT, "--image", str(img)])
    base = Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).float().eval()
    before = stock(base, ckpt, [img])
    tuned = PeftModel.from_pretrained(base, str(out / "final")).eval()
    assert ids == [stock(tuned, ckpt, [img])]
    assert ids[0] != before  # the adapter changed the answer: it was applied


def _error(capsys, args) -> str:
    rc = main(["generate", *args])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_bad_images_and_text_models_are_one_line(ckpt, tmp_path, monkeypatch, capsys):
    from PIL import Image

    monkeypatch.chdir(tmp_path)
    assert "--image 1: 'gone.png' does not exist" in _error(capsys, [str(ckpt), "--prompt", "x", "--image", "gone.png"])
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    line = _error(capsys, [str(ckpt), "--prompt", "x", "--image", "junk.png"])
    assert "--image 1" in line and "is not an image PIL can read" in line
    rows = tmp_path / "p.jsonl"
    rows.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image", "image": "img/missing.png"}, {"type": "text", "text": "x"}]}]}) + "\n")  # fmt: skip
    line = _error(capsys, [str(ckpt), "--prompts", str(rows)])
    assert f"{rows}:2: message 0 of 'messages', content part 0" in line and "missing.png' does not exist" in line
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # 23 x 37 is over twice it: PIL's bomb error
    line = _error(capsys, [str(ckpt), "--prompt", "x", "--image", str(ckpt.parent / "0.png")])
    assert "larger than PIL's MAX_IMAGE_PIXELS" in line
    monkeypatch.undo()
    line = _error(capsys, ["tiny-qwen3_5", "--prompt", "x", "--image", str(ckpt.parent / "0.png")])
    assert "model 'tiny-qwen3_5' is not a vision-language model" in line
    assert "--image goes with --prompt" in _error(capsys, [str(ckpt), "--prompts", str(rows), "--image", "a.png"])


def test_chat_takes_images(ckpt, monkeypatch, capsys):
    """`chat --image` gives the first message its image, `/image PATH` the next one; each reply is stock's on the
    conversation so far (the first image stays in it)."""
    import io
    import sys

    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    import hybridtune.infer.chat as chat_command

    model = Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).float().eval()
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    img0, img1 = ckpt.parent / "0.png", ckpt.parent / "1.png"
    seen = []
    real = chat_command.complete
    monkeypatch.setattr(chat_command, "complete", lambda *a, **k: seen.extend(real(*a, **k)) or seen[-1:])
    monkeypatch.chdir(ckpt.parent)
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\n/image nowhere.png\n/image 1.png\nAnd this?\n"))
    assert main(["chat", str(ckpt), "--image", "0.png", "--max_new_tokens", str(NEW)]) == 0
    out = capsys.readouterr().out
    assert "error: stdin line 2: 'nowhere.png' does not exist" in out  # said; the chat goes on
    assert "(image 1.png goes with your next message)" in out
    first = stock(model, ckpt, [img0])
    assert [ids for ids, _ in seen] == [first, seen[1][0]] and len(seen) == 2
    messages = [
        {"role": "user", "content": PLACEHOLDER + PROMPT},
        {"role": "assistant", "content": tok.decode(first, skip_special_tokens=True)},
        {"role": "user", "content": PLACEHOLDER + "And this?"},
    ]
    assert seen[1][0] == stock(model, ckpt, [img0, img1], messages=messages)
    line = _error_of(capsys, ["chat", "tiny-qwen3_5", "--image", str(img1)])
    assert "model 'tiny-qwen3_5' is not a vision-language model" in line


def _error_of(capsys, args) -> str:
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    return next(x for x in err.splitlines() if x.startswith("error: "))
