"""GRPO on a vision-language checkpoint (`Qwen3_5ForConditionalGeneration`, the tiny one of tests/data/vision/vl_tiny.py,
CPU): the rollout's greedy tokens on text prompts equal transformers' own `generate` (which gives the model its M-RoPE
positions itself), alone and left-padded beside prompts of other lengths; `train --objective grpo` trains it on chat
prompts with a reward written as TRL documents it for conversational prompts (`completion[0]["content"]`,
`trainer_state`), the mean reward rising on a learnable reward and the `done:` line giving its trend, the vision
tower's weights saved untouched; a row with an image is refused in one line (exit 2)."""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import GenerationConfig

from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import tokenizer_for
from hybridtune.runtime.model import build_model
from hybridtune.runtime.rollout import Rollout, sample_group, sample_groups
from train_runs import metrics_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "data" / "vision"))
import vl_tiny  # noqa: E402

# A reward in TRL's conversational signature: the share of newlines in the completion (the tiny random model's most
# likely token at a low temperature, so the policy can learn it in a few steps). It checks what it is given as TRL
# gives it: completions as lists of one assistant message, prompts as lists of messages, the row's other columns,
# completion_ids and a TrainerState.
REWARD = """
def newlines(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
    assert all(isinstance(c, list) and c[0]["role"] == "assistant" for c in completions), completions
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts), prompts
    assert all(isinstance(a, str) for a in answer) and len(completion_ids) == len(completions)
    assert trainer_state.global_step >= 0
    return [completion[0]["content"].count("\\n") / len(ids) for completion, ids in zip(completions, completion_ids)]
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return vl_tiny.make_checkpoint(tmp_path_factory.mktemp("vl") / "model")


@pytest.fixture(scope="module")
def policy(checkpoint):
    """The checkpoint as the trainer builds it under LoRA, its adapters moved so that they change the tokens."""
    cfg = load_config(None, {"base_model": str(checkpoint), "adapter": "lora", "lora_dropout": 0.0, "seed": 3})
    source = resolve_source(str(checkpoint))
    model = build_model(cfg, source, tokenizer_for(source), torch.device("cpu"), bf16=False).model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def stock_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    config = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, num_beams=1, eos_token_id=None)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt) :].tolist()


def test_greedy_rollouts_of_text_prompts_equal_transformers_generate(policy):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    prompts = [torch.randint(0, 400, (int(n),), generator=g).tolist() for n in torch.randint(3, 70, (3,), generator=g)]
    assert len({len(p) for p in prompts}) > 1
    policy.eval()
    want = [stock_greedy(policy, p, 9) for p in prompts]
    assert len({tuple(w) for w in want}) > 1  # (the prompts lead to different tokens)
    alone = [sample_group(policy, p, [None], 9, stop=[], temperature=0.0)[0] for p in prompts]
    assert alone == [Rollout(w, truncated=True) for w in want]
    together = sample_groups(policy, prompts, 2, 9, stop=[], temperature=0.0)  # left-padded in one state
    assert together == [[Rollout(w, truncated=True)] * 2 for w in want]


def test_grpo_trains_a_vision_language_checkpoint_with_a_trl_conversational_reward(
    checkpoint, tmp_path, monkeypatch, capsys
):
    rng = random.Random()
    rows = []
    for _ in range(16):
        a, b = rng.randrange(9), rng.randrange(9)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    vl_tiny.write_rows(tmp_path / "prompts.jsonl", rows)
    (tmp_path / "rewards.py").write_text(REWARD)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--base_model", str(checkpoint), "--objective", "grpo", "--adapter", "full", "--dataset",
            "prompts.jsonl", "--reward_funcs", "rewards.py:newlines", "--num_generations", "4",
            "--max_completion_length", "8", "--micro_batch_size", "2", "--max_steps", "12", "--sequence_len", "64",
            "--val_set_size", "0", "--learning_rate", "5e-3", "--warmup_steps", "0", "--logging_steps", "1",
            "--temperature", "0.3", "--output_dir", str(out)]  # fmt: skip
    assert main(argv) == 0
    rewards = [r["reward"] for r in metrics_rows(out, "train")]
    assert len(rewards) == 12
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.05, rewards  # the policy learned the reward
    done = next(line for line in capsys.readouterr().err.splitlines() if "done:" in line)
    trend = re.search(r"reward (\S+) -> (\S+);", done)
    assert trend and [float(x) for x in trend.groups()] == pytest.approx([rewards[0], rewards[-1]], abs=1e-4), done
    # the vision tower (frozen, idle under text prompts) saved as it was; the language model trained
    before = load_file(str(checkpoint / "model.safetensors"))
    after = load_file(str(out / "final" / "model.safetensors"))
    visual = [k for k in before if ".visual." in f".{k}"]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)
    assert any(not torch.equal(before[k], after[k]) for k in before if k not in visual)


@pytest.mark.parametrize(
    "row, what",
    [
        (vl_tiny.chat("Which colour?", {"type": "image", "image": "a.png"}), "content part 1 (type 'image')"),
        ({"prompt": "Describe <image>", "images": ["a.png"]}, "column 'images'"),
        ({"prompt": "Describe this <image>"}, "an <image> placeholder in field 'prompt'"),
    ],
)
def test_a_row_with_media_is_refused_in_one_line(checkpoint, tmp_path, row, what, capsys):
    vl_tiny.write_image(tmp_path / "a.png", 16, 16)
    vl_tiny.write_rows(tmp_path / "d.jsonl", [{"prompt": "1+1=", "answer": "2"}, row])
    code = main(["train", "--base_model", str(checkpoint), "--objective", "grpo", "--dataset",
                 str(tmp_path / "d.jsonl"), "--reward_funcs", "exact_answer", "--max_steps", "1",
                 "--output_dir", str(tmp_path / "run")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    (line,) = [x for x in err.splitlines() if x.startswith("error:")]
    assert "d.jsonl:2" in line and what in line and "objective grpo samples from text prompts only" in line, line
