"""`hybridtune train --objective grpo` end to end on the CPU (tiny Qwen3.5 preset): prompts from prompt/answer rows and
from chats, completions sampled in process before each step, rewards (a user's file and a built-in) logged per
function with TRL's names, kl and clip ratios, completion lengths, generation time; num_iterations reuses a batch of
completions; a reward function that raises stops the run with one line naming it and the row (exit 2)."""

from __future__ import annotations

import json
import logging
import math
import random

import pytest

from hybridtune.cli import main
from train_runs import make_cfg, metrics_rows, run

REWARDS = """
def has_digit(prompts, completions, answer, **kwargs):  # conversational prompts: TRL's messages
    texts = [c[0]["content"] for c in completions]
    return [float(any(ch.isdigit() for ch in c)) + 0.01 * len(c) for c in texts]

def broken(prompts, completions, answer, **kwargs):
    return [1.0 if a != "7" else float("x") for a in answer]
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    rng = random.Random(2)
    root = tmp_path_factory.mktemp("grpo")
    rows = []
    for _ in range(24):
        a, b = rng.randrange(5), rng.randrange(5)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_grpo_trains_and_logs_rewards_kl_and_generation(tmp_path, data, adapter, caplog, monkeypatch):
    monkeypatch.chdir(data)  # (reward_funcs name rewards.py relative to the working directory)
    out = tmp_path / "run"
    cfg = make_cfg(out, str(data / "prompts.jsonl"), objective="grpo", adapter=adapter, max_steps=4, sequence_len=64,
                   lora_dropout=0.0, num_generations=3, max_completion_length=6, micro_batch_size=2,
                   gradient_accumulation_steps=1, num_iterations=2, beta=0.05, epsilon=0.1, warmup_steps=0,
                   reward_funcs=["rewards.py:has_digit", "exact_answer"], reward_weights=[1.0, 2.0],
                   learning_rate=1e-3, val_set_size=0)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        res = run(cfg)
    assert res.steps == 4 and res.final_dir
    assert all(math.isfinite(x) for x in res.losses)
    rows = metrics_rows(out, "train")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    names = ["reward", "reward_std", "rewards/has_digit/mean", "rewards/has_digit/std", "rewards/exact_answer/mean",
             "kl", "clip_ratio/region_mean", "completions/mean_length", "time/generation_s"]  # fmt: skip
    for r in rows:
        for name in names:
            assert isinstance(r[name], float) and math.isfinite(r[name]), (name, r)
        assert 1 <= r["completions/mean_length"] <= 6
        assert r["reward"] == pytest.approx(r["rewards/has_digit/mean"] + 2 * r["rewards/exact_answer/mean"])
    # num_iterations 2: steps 1 and 2 train on one batch of completions (its rewards), 3 and 4 on the next
    assert rows[0]["reward"] == rows[1]["reward"] and rows[2]["completions/mean_length"] > 0
    assert rows[0]["kl"] == pytest.approx(0, abs=1e-7)  # step 1: the policy is its reference
    assert rows[1]["kl"] > 0  # step 2: the update moved it (same completions)
    step2 = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step     2/4"))
    assert "reward " in step2 and "rewards/has_digit/mean " in step2 and "kl " in step2, step2


def test_a_reward_that_returns_a_non_number_stops_the_run_with_one_line(tmp_path, data, capsys, monkeypatch):
    monkeypatch.chdir(data)
    rows = [{"prompt": "3+4=", "answer": "7"}, {"prompt": "1+1=", "answer": "2"}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", "--objective", "grpo", "--dataset", str(tmp_path / "p.jsonl"), "--output_dir",
                 str(tmp_path / "run"), "--max_steps", "1", "--num_generations", "2", "--max_completion_length", "3",
                 "--reward_funcs", "rewards.py:broken", "--val_set_size", "0", "--micro_batch_size", "2"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "reward function 'rewards.py:broken' raised ValueError" in err[-1] and "p.jsonl:1" in err[-1], err


def test_a_reward_that_fails_mid_run_keeps_the_steps_done(tmp_path, data, capsys):
    (tmp_path / "late.py").write_text(
        "calls = []\n"
        "def late(completions, **kwargs):\n"
        "    calls.append(1)\n"
        "    if len(calls) > 2:\n"
        "        raise RuntimeError('boom')\n"
        "    return [0.5] * len(completions)\n"
    )
    code = main(["train", "--objective", "grpo", "--dataset", str(data / "prompts.jsonl"), "--output_dir",
                 str(tmp_path / "run"), "--max_steps", "4", "--num_generations", "2", "--max_completion_length", "3",
                 "--reward_funcs", f"{tmp_path / 'late.py'}:late", "--val_set_size", "0"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "reward function" in err[-1] and "late' raised RuntimeError: boom on row " in err[-1], err[-1]
    assert (tmp_path / "run" / "checkpoint-2" / "checkpoint.json").is_file()  # steps 1 and 2 kept


def test_prompts_from_chats_and_prompt_rows_and_a_bad_row(tmp_path):
    from hybridtune.config import load_config
    from hybridtune.errors import DataError
    from hybridtune.models.loading import tokenizer_for
    from hybridtune.train.objectives.grpo_rollouts import load_prompts

    tok = tokenizer_for("tiny-qwen3_5")
    chats = [{"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}]
    rows = [{"prompt": "a long plain prompt " * 20, "answer": "x", "level": 3}]
    (tmp_path / "c.jsonl").write_text(json.dumps(chats[0]) + "\n")
    (tmp_path / "p.jsonl").write_text(json.dumps(rows[0]) + "\n")
    cfg = load_config(None, {"objective": "grpo", "max_prompt_length": 16,
                             "datasets": [{"path": str(tmp_path / "c.jsonl")}, {"path": str(tmp_path / "p.jsonl")}]})  # fmt: skip
    chat, plain = load_prompts(cfg, tok).prompts
    assert tok.decode(chat.input_ids) == "<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n"
    assert chat.columns == {"answer": "4"} and chat.where.endswith("c.jsonl:1") and set(chat.loss_mask) == {0}
    assert len(plain.input_ids) == 16 and plain.columns == {"answer": "x", "level": 3}  # its last 16 tokens
    assert tok.decode(plain.input_ids).endswith("plain prompt ")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"question": "?"}) + "\n")
    cfg = load_config(None, {"objective": "grpo", "dataset": str(tmp_path / "bad.jsonl")})
    with pytest.raises(DataError, match=r"bad.jsonl:1: objective grpo reads a 'prompt' .* this row has \['question'\]"):
        load_prompts(cfg, tok)
