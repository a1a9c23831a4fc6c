"""`hybridtune generate` equals stock transformers (+ peft) decoding token for token on a trained tiny run: greedy
and seeded sampling, a batch of prompts with left padding, final/ (full model, LoRA adapter) and a checkpoint."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from infer_runs import PROMPTS
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridtune import cli
from hybridtune.errors import ModelError
from hybridtune.infer.generate import read_prompts
from hybridtune.infer.load import open_model
from hybridtune.runtime.generation import Sampling, complete, eos_ids, generate, render

FAMILIES = [
    ("tiny-qwen3_5", "full"),
    ("tiny-qwen3_5", "lora"),
    pytest.param("tiny-qwen3_next", "full", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3_next", "lora", marks=pytest.mark.slow),
]
NEW = 12


def stock(final, adapter: str):
    """final/ as a user loads it with transformers and peft alone."""
    tok = AutoTokenizer.from_pretrained(final)
    if adapter == "full":
        return AutoModelForCausalLM.from_pretrained(final).eval(), tok
    base_dir = final / json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # a preset's base_model/, recorded relative to final/
    return PeftModel.from_pretrained(base, final).eval(), tok


@torch.inference_mode()
def stock_new_tokens(model, tok, prompts: list[str], **decoding) -> list[list[int]]:
    """Stock chat-template rendering, left padding and generate(); each row's new tokens up to its first eos."""
    texts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in prompts
    ]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, max_new_tokens=NEW, **decoding)[:, enc["input_ids"].shape[1] :].tolist()
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    return [row[: next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in out]


def ours(model, tok, prompts, sampling: Sampling) -> list[list[int]]:
    texts = [render(tok, p, chat=True) for p in prompts]
    return [ids for ids, _ in complete(model, tok, texts, sampling, chat=True, batch_size=len(prompts))]


@pytest.mark.parametrize("preset, adapter", FAMILIES)
def test_generate_equals_stock_transformers_and_peft(trained, preset, adapter):
    out = trained(preset, adapter)
    opened = open_model(str(out))  # the output directory stands for its final/
    assert opened.path == out / "final" and opened.step == 4
    ref_model, ref_tok = stock(out / "final", adapter)
    greedy = ours(opened.model, opened.tokenizer, PROMPTS, Sampling(max_new_tokens=NEW))
    assert greedy == stock_new_tokens(ref_model, ref_tok, PROMPTS, do_sample=False)
    # Seeded sampling: varied tokens, so the recurrent cache's every step matters.
    torch.manual_seed(7)
    ref = stock_new_tokens(ref_model, ref_tok, PROMPTS, do_sample=True, temperature=1.0, top_p=1.0, top_k=None)
    sampled = ours(opened.model, opened.tokenizer, PROMPTS, Sampling(max_new_tokens=NEW, temperature=1.0, seed=7))
    assert sampled == ref
    assert len({tuple(r) for r in sampled}) > 1 or len(set(sampled[0])) > 1, "sampling should give varied tokens"


@pytest.mark.parametrize("adapter", ["full", "lora"])
def test_a_checkpoint_generates_as_its_export_does(trained, tmp_path, adapter):
    """checkpoint-2 (DCP) opened directly and through `hybridtune export` + stock loading give the same tokens."""
    from hybridtune.infer.export_command import export_checkpoint

    out = trained("tiny-qwen3_5", adapter)
    opened = open_model(str(out / "checkpoint-2"))
    assert opened.kind == "checkpoint" and opened.step == 2
    final = export_checkpoint(out / "checkpoint-2", tmp_path / "exported")
    ref_model, ref_tok = stock(final, adapter)
    sampling = Sampling(max_new_tokens=NEW, temperature=1.0, seed=3)
    got = ours(opened.model, opened.tokenizer, PROMPTS, sampling)
    torch.manual_seed(3)
    assert got == stock_new_tokens(ref_model, ref_tok, PROMPTS, do_sample=True, temperature=1.0, top_p=1.0, top_k=None)


def test_a_completion_stops_at_the_end_of_its_turn(trained):
    opened = open_model(str(trained("tiny-qwen3_5", "full") / "final"))
    model, tok = opened.model, opened.tokenizer
    eos = eos_ids(model, tok)
    assert eos == [tok.eos_token_id]  # this run's generation config and tokenizer agree
    text = render(tok, "17+25=", True)
    sampling = Sampling(max_new_tokens=NEW, temperature=1.5, seed=1)  # varied tokens (greedy ends at once here)
    [(ids, why)] = complete(model, tok, [text], sampling)
    assert not any(t in eos for t in ids[:-1])
    assert (why == "stop") == (ids[-1] in eos) and (why == "stop" or len(ids) == NEW)
    # Make a token the model emits on the way an end of turn too: decoding stops at its first occurrence, keeping it.
    assert len(ids) >= 3, ids
    target = next(t for t in reversed(ids) if t not in eos)
    model.generation_config.eos_token_id = [target]
    try:
        assert eos_ids(model, tok) == [target, tok.eos_token_id]
        [(cut, why)] = complete(model, tok, [text], sampling)
    finally:
        model.generation_config.eos_token_id = tok.eos_token_id
    assert why == "stop" and cut == ids[: ids.index(target) + 1]


def test_generate_command_prints_json_for_prompts_and_a_file(trained, tmp_path, capsys):
    out = trained("tiny-qwen3_5", "lora")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": PROMPTS[1]})
        + "\n"
        + json.dumps({"messages": [{"role": "user", "content": PROMPTS[2]}]})
        + "\n"
    )
    argv = ["generate", str(out / "final"), "--prompt", PROMPTS[0], "--prompts", str(prompts), "--json"]
    assert cli.main([*argv, "--max_new_tokens", str(NEW)]) == 0
    rows = json.loads(capsys.readouterr().out)
    opened = open_model(str(out / "final"))
    want = generate(opened.model, opened.tokenizer, PROMPTS, Sampling(max_new_tokens=NEW))
    assert [r["completion"] for r in rows] == [c.completion for c in want]
    assert [r["new_tokens"] for r in rows] == [c.new_tokens for c in want]
    assert rows[0]["prompt"] == PROMPTS[0] and rows[0]["finish_reason"] in ("stop", "length")


def test_plain_text_prompts_skip_the_chat_template(trained):
    opened = open_model(str(trained("tiny-qwen3_5", "full") / "final"))
    assert render(opened.tokenizer, "Once upon", chat=False) == "Once upon"
    assert "<|im_start|>user" in render(opened.tokenizer, "Once upon", chat=True)


def test_prompt_files(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first\n\nsecond\n")
    assert read_prompts(str(lines)) == ["first", "second"]
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": 1}\n')
    with pytest.raises(Exception, match=r"p.jsonl:2: expected an object with \"prompt\""):
        read_prompts(str(bad))


@pytest.mark.parametrize("command", ["generate", "chat", "eval", "export"])
def test_every_command_has_help(command, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: hybridtune {command}" in capsys.readouterr().out


def test_bad_input_is_one_line(tmp_path, capsys):
    assert cli.main(["generate", "tiny-qwen3_5"]) == 2
    assert "no prompt" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="holds no model"):
        open_model(str(tmp_path / "empty"))
    assert cli.main(["generate", "tiny-qwen3_5", "--prompt", "x", "--max_new_tokens", "0"]) == 2
    assert "--max_new_tokens 0: give at least 1" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter
def test_generate_in_a_fresh_interpreter(trained):
    import subprocess

    out = trained("tiny-qwen3_5", "full")
    argv = [sys.executable, "-m", "hybridtune", "generate", str(out), "--prompt", PROMPTS[0], "--json"]
    done = subprocess.run([*argv, "--max_new_tokens", str(NEW)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    opened = open_model(str(out))
    [want] = generate(opened.model, opened.tokenizer, PROMPTS[:1], Sampling(max_new_tokens=NEW))
    assert json.loads(done.stdout) == [{**want.__dict__}]
