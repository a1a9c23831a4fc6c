"""`hybridtune generate` and `chat` with videos (infer/video_prompts.py) on a tiny vision-language checkpoint (random
weights widened so greedy decoding depends on the video): token for token what stock transformers generates from
the same processed inputs (the tokenizer's template, the video token widened by transformers' own
`Qwen3VLProcessor.replace_video_token`, `generate` with every input the processor returns: stock_vl.py). The pixel values
are data/video.py's FrameProcessor's on both sides (Qwen3VLVideoProcessor itself needs torchvision, not installed
here). --video as a folder and as frames joined by commas, a prompts file's video part (relative to the file),
chat's --video; a missing video is one line, exit 2."""

from __future__ import annotations

import io
import json

import pytest
import stock_vl
import torch
import vl_tiny

import hybridtune.runtime.generation as generation
from hybridtune.cli import main

PROMPT = "What happens?"
NEW = 28  # (random weights: the two videos part only after 25 tokens)
FPS = 2.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, tok = vl_tiny.build_model(0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    d = tmp_path_factory.mktemp("vl-video") / "ckpt"
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    vl_tiny.image_processor().save_pretrained(str(d))
    vl_tiny.video_processor().save_pretrained(str(d))
    vl_tiny.write_frames(d.parent / "clip", 4, 24, 16, seed=1)
    vl_tiny.write_frames(d.parent / "other", 3, 16, 24, seed=2)
    return d


def stock(model, directory, folder, fps=FPS) -> list[int]:
    """Greedy new tokens of stock transformers for one user turn: the video, then PROMPT (stock_vl.py: every input
    the checkpoint's processor returns, mm_token_type_ids too)."""
    proc = stock_vl.processor(directory)
    text = stock_vl.prompt(proc, [{"role": "user", "content": stock_vl.VIDEO + PROMPT}])
    return stock_vl.greedy(model, proc, stock_vl.video_inputs(proc, text, folder, fps), NEW)


def ours(monkeypatch, capsys, args) -> list[list[int]]:
    seen = vl_tiny.spy_completions(monkeypatch, generation)
    rc = main(["generate", *args, "--max_new_tokens", str(NEW), "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert len(json.loads(out.out)) == len(seen)
    return seen


@pytest.fixture(scope="module")
def model(ckpt):
    from transformers import Qwen3_5ForConditionalGeneration

    return Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).float().eval()


def test_generate_with_a_video_equals_stock_transformers(ckpt, model, monkeypatch, capsys):
    monkeypatch.chdir(ckpt.parent)  # --video paths are relative to the working directory
    want = stock(model, ckpt, ckpt.parent / "clip")
    assert ours(monkeypatch, capsys, [str(ckpt), "--prompt", PROMPT, "--video", "clip", "--fps", "2"]) == [want]
    frames = ",".join(f"clip/{p.name}" for p in sorted((ckpt.parent / "clip").iterdir()))
    assert ours(monkeypatch, capsys, [str(ckpt), "--prompt", PROMPT, "--video", frames]) == [want]
    # the video is read: another video, or another fps (the timestamps), is another answer
    assert stock(model, ckpt, ckpt.parent / "other") != want
    assert stock(model, ckpt, ckpt.parent / "clip", fps=0.25) != want
    slow = ours(monkeypatch, capsys, [str(ckpt), "--prompt", PROMPT, "--video", "clip", "--fps", "0.25"])
    assert slow == [stock(model, ckpt, ckpt.parent / "clip", fps=0.25)]


def test_prompts_file_video_parts_beside_text_prompts(ckpt, model, tmp_path, monkeypatch, capsys):
    part = {"type": "video", "video": "other", "fps": FPS}
    rows = [
        {"messages": [{"role": "user", "content": [part, {"type": "text", "text": PROMPT}]}]},
        {"prompt": "Hello"},
    ]
    prompts = ckpt.parent / "video-prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path)  # elsewhere: the paths are the file's
    ids = ours(monkeypatch, capsys, [str(ckpt), "--prompts", str(prompts)])
    assert len(ids) == 2 and ids[1] == stock(model, ckpt, ckpt.parent / "other")  # (the text prompt goes first)


def test_chat_takes_a_video_for_the_first_message(ckpt, model, monkeypatch, capsys):
    monkeypatch.chdir(ckpt.parent)
    monkeypatch.setattr("sys.stdin", io.StringIO(PROMPT + "\n"))
    seen = []
    real = generation.complete
    monkeypatch.setattr(generation, "complete", lambda *a, **k: seen.extend(real(*a, **k)) or seen[-1:])
    rc = main(["chat", str(ckpt), "--video", "clip", "--max_new_tokens", str(NEW)])
    assert rc == 0, capsys.readouterr().err
    assert [ids for ids, _ in seen] == [stock(model, ckpt, ckpt.parent / "clip")]


def test_a_missing_video_is_one_line(ckpt, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = main(["generate", str(ckpt), "--prompt", PROMPT, "--video", "nowhere"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "nowhere" in err[0] and "Traceback" not in err[0]
