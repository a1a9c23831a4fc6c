"""GRPO's rewards: a user's `file.py:function` loaded from the path the config names, the built-ins, weights, TRL's
metric names, and every bad case as one line naming the function and the row (exit 2 through the CLI's UserError)."""

from __future__ import annotations

import textwrap

import pytest
import torch

from hybridtune.errors import ConfigError, UserError
from hybridtune.train.objectives.rewards import (
    RewardError,
    extract_answer,
    load_reward_funcs,
    reward_metrics,
    score,
    weighted,
)

USER = textwrap.dedent(
    """
    def correct(prompts, completions, answer, **kwargs):
        return [2.0 if c.strip().endswith(str(a)) else 0.0 for c, a in zip(completions, answer)]

    def short(completions, completion_ids, **kwargs):
        return [-len(ids) for ids in completion_ids]

    def explodes(completions, answer, **kwargs):
        return [1.0 / (len(c) - 3) for c in completions]

    def text(completions, **kwargs):
        return ["high" if "1" in c else 0.0 for c in completions]

    def too_few(completions, **kwargs):
        return [1.0]
    """
)


def call(funcs, completions, answers):
    ids = [list(range(len(c))) for c in completions]
    where = [f"data.jsonl:{i + 1}" for i in range(len(completions))]
    return score(funcs, ["q"] * len(completions), completions, ids, {"answer": answers}, where)


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    return "my_rewards.py"


def test_a_users_functions_and_the_builtins_score_with_weights(user_file):
    funcs = load_reward_funcs([f"{user_file}:correct", f"{user_file}:short", "exact_answer", "format"], 16)
    completions = ["<think>2+2</think> so 4", "the answer is \\boxed{5}", "1,000", "<think>unclosed 4"]
    answers = ["4", "4", "1000", "4"]
    got = call(funcs, completions, answers)
    want = torch.tensor(
        [[2.0, -23, 1, 1], [0, -23, 0, 1], [0, -5, 1, 1], [2, -17, 1, 0]], dtype=torch.float64
    )  # exact_answer: the last number, a \boxed{} over it, numbers by value; format: <think> closed and an answer
    assert torch.equal(got, want)
    total = weighted(got, [1.0, 0.5, 2.0, 0.25])
    assert total.tolist() == pytest.approx([2 - 11.5 + 2 + 0.25, -11.5 + 0.25, -2.5 + 2 + 0.25, 2 - 8.5 + 2])
    m = reward_metrics(funcs, got, total, 2)
    assert m["rewards/correct/mean"] == 1.0 and m["rewards/exact_answer/mean"] == 0.75
    assert m["reward"] == pytest.approx(float(total.mean()))
    assert m["reward_std"] == pytest.approx(float(total.view(2, 2).std(1).mean()))
    assert m["frac_reward_zero_std"] == 0.0


def test_builtin_answers_and_length_penalty():
    assert extract_answer("so \\boxed{\\frac{1}{2}} done") == "\\frac{1}{2}"
    assert extract_answer("Answer: 42.") == "42" and extract_answer("#### -7") == "-7"
    assert extract_answer("no digits") is None
    funcs = load_reward_funcs(["boxed_answer", "length_penalty"], 10)
    got = call(funcs, ["42", "\\boxed{42}"], ["42", "42"])
    assert got.tolist() == [[0.0, -0.2], [1.0, -1.0]]


@pytest.mark.parametrize(
    "name,completions,message",
    [
        ("explodes", ["abcdefg", "abc", "x"], r"reward function 'my_rewards.py:explodes' raised ZeroDivisionError: "
         r"float division by zero on row data.jsonl:2 \(completion 1\)"),
        ("text", ["2", "1"], r"'my_rewards.py:text' returned 'high' for completion 1 of row data.jsonl:2; it must "
         r"return a finite number"),
        ("too_few", ["a", "b"], r"'my_rewards.py:too_few' returned list of length 1; it must return a list of 2"),
    ],
)  # fmt: skip
def test_a_reward_that_raises_or_returns_a_non_number_is_one_line_naming_it_and_the_row(
    user_file, name, completions, message
):
    funcs = load_reward_funcs([f"{user_file}:{name}"], 8)
    with pytest.raises(RewardError, match=message) as e:
        call(funcs, completions, ["0"] * len(completions))
    assert isinstance(e.value, UserError) and e.value.exit_code == 2 and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "spec,message",
    [
        ("exact_answr", r"neither a built-in .* Did you mean 'exact_answer'"),
        ("nofile.py:f", r"'nofile.py:f': no file nofile.py"),
        ("my_rewards.py:corect", r"defines no function 'corect'.*Did you mean 'correct'"),
    ],
)
def test_a_bad_reward_funcs_entry_is_one_line(user_file, spec, message):
    with pytest.raises(ConfigError, match=message):
        load_reward_funcs([spec], 8)


def test_no_reward_funcs_is_one_line():
    with pytest.raises(ConfigError, match="objective grpo needs reward_funcs"):
        load_reward_funcs([], 8)
