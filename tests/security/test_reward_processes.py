"""`reward_processes: N` (issue 47, optional part): the user's reward functions run in spawned worker processes, on
the bytes the training process read (an edit of the file after the start changes nothing), giving the rewards the
same function gives in process; what they do to their process (its working directory, its environment) stays
there; what they raise is one line naming the row; a call past `reward_timeout` ends in one line, fast, its workers
stopped; `train --reward_processes 2` trains."""

from __future__ import annotations

import json
import os
import random
import time

import pytest

from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.train.objectives.rewards import RewardError, load_reward_funcs, score

USER = """
import os, time

def digits(completions, answer, **kwargs):
    os.environ["HT_REWARD_RAN"] = "1"
    os.chdir("/")
    return [sum(ch.isdigit() for ch in c) + (c.strip() == a) for c, a in zip(completions, answer)]

def bad(completions, **kwargs):
    return [1.0 if "x" not in c else 1 / 0 for c in completions]

def slow(completions, **kwargs):
    time.sleep(60)
    return [0.0] * len(completions)
"""


def completions(n: int, rng: random.Random) -> list[str]:
    return ["".join(rng.choice("ab12 34") for _ in range(rng.randrange(1, 9))) for _ in range(n)]


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(USER)
    return path


def test_rewards_in_worker_processes_equal_those_in_process_and_keep_their_side_effects(user_file, monkeypatch):
    monkeypatch.delenv("HT_REWARD_RAN", raising=False)
    rng = random.Random()
    texts = completions(7, rng)
    answers = [rng.choice(texts), *(str(rng.randrange(9)) for _ in range(6))]
    where = [f"d.jsonl:{i + 1}" for i in range(7)]
    args = (["q"] * 7, texts, [[1]] * 7, {"answer": answers}, where)
    pooled = load_reward_funcs([f"{user_file}:digits", "exact_answer"], 8, processes=2, timeout=60)
    in_process = load_reward_funcs([f"{user_file}:digits", "exact_answer"], 8)
    user_file.write_text(USER.replace("ch.isdigit()", "0"))  # an edit after the start: the workers run what was read
    here = os.getcwd()
    got = score(pooled, *args)
    assert os.getcwd() == here and "HT_REWARD_RAN" not in os.environ  # the worker's process, not this one
    want = score(in_process, *args)
    assert os.getcwd() == here  # (in process: the fence puts the directory back; the environment it cannot)
    os.environ.pop("HT_REWARD_RAN", None)
    assert got.tolist() == want.tolist() and got[:, 0].sum() > 0


def test_a_reward_that_raises_in_a_worker_is_one_line_naming_the_row(user_file):
    texts = ["a", "b", "ax", "c"]
    (bad,) = load_reward_funcs([f"{user_file}:bad"], 8, processes=1, timeout=60)
    with pytest.raises(RewardError, match=r"'.*user.py:bad' raised ZeroDivisionError: division by zero on row d:3 "):
        score([bad], ["q"] * 4, texts, [[1]] * 4, {}, [f"d:{i + 1}" for i in range(4)])


def test_a_reward_past_its_timeout_is_one_line_and_its_workers_stop(user_file):
    (slow,) = load_reward_funcs([f"{user_file}:slow"], 8, processes=1, timeout=1.5)
    t = time.monotonic()
    with pytest.raises(
        RewardError, match=r"'.*user.py:slow' did not return within reward_timeout 1.5 s on the rows of d:1"
    ):
        score([slow], ["q"] * 2, ["a", "b"], [[1]] * 2, {}, ["d:1", "d:2"])
    assert time.monotonic() - t < 30  # (not once per row, not the 60 s sleep)


def test_the_keys_are_checked():
    with pytest.raises(ConfigError, match="reward_processes"):
        load_config(None, {"objective": "grpo", "reward_processes": -1})
    with pytest.raises(ConfigError, match="reward_timeout"):
        load_config(None, {"objective": "grpo", "reward_timeout": 0})


def test_train_with_reward_processes(tmp_path, user_file):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in random.sample(range(50), 4)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = main(["train", "--objective", "grpo", "--dataset", str(tmp_path / "d.jsonl"), "--reward_funcs",
               f"{user_file}:digits", "--reward_processes", "2", "--num_generations", "2", "--max_completion_length",
               "3", "--micro_batch_size", "2", "--max_steps", "2", "--sequence_len", "64", "--val_set_size", "0",
               "--output_dir", str(tmp_path / "run")])  # fmt: skip
    assert rc == 0 and (tmp_path / "run" / "final").is_dir()
