"""Rewards inside a fence (REDTEAM2.md defects 2, 3, 14, 15, 17): a reward that `os.chdir`s (in its calls or at
import) cannot move the run's checkpoints, `final/` or `base_model/` (the working directory is put back, said once);
a reward that edits `completion_ids`, `prompts` or a column in place changes neither the tokens trained nor what the
next call is given; a BaseException subclass from a reward is one line naming it and the row (exit 2) while Ctrl-C
still stops the run; a step whose completions are all truncated and masked says so; `--reward_weights 1.0,2.0`
parses as a list."""

from __future__ import annotations

import json
import os
import random

import pytest

from hybridtune.cli import main
from hybridtune.config import load_config, parse_overrides
from hybridtune.errors import ConfigError
from hybridtune.train.objectives import grpo_rollouts, reward_fence
from hybridtune.train.objectives.rewards import RewardError, RewardFunc, score

CHDIR = """
import os
os.chdir(os.environ["HT_ELSEWHERE"])  # at import, too

def fn(prompts, completions, **kwargs):
    os.chdir(os.environ["HT_ELSEWHERE"])
    return [float(len(c[0]["content"])) for c in completions]
"""


def rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randrange(20), rng.randrange(20)
        out.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)})
    return out


def grpo_argv(data: str, reward: str, out: str, *more: str) -> list[str]:
    return ["train", "--objective", "grpo", "--dataset", data, "--reward_funcs", reward, "--num_generations", "2",
            "--max_completion_length", "4", "--micro_batch_size", "2", "--sequence_len", "64", "--val_set_size", "0",
            "--output_dir", out, *more]  # fmt: skip


def test_a_reward_that_changes_the_working_directory_moves_nothing(tmp_path, monkeypatch, capsys):
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    (elsewhere / "runs" / "g").mkdir(parents=True)
    (elsewhere / "runs" / "g" / "notes.txt").write_text("mine\n")
    work.mkdir()
    (work / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(8, seed=random.randrange(1 << 20))))
    (work / "chdir.py").write_text(CHDIR)
    monkeypatch.setenv("HT_ELSEWHERE", str(elsewhere))
    monkeypatch.chdir(work)
    rc = main(grpo_argv("data.jsonl", "chdir.py:fn", "runs/g", "--max_steps", "3", "--save_steps", "1"))
    assert rc == 0
    assert os.getcwd() == str(work)
    assert sorted(p.name for p in (elsewhere / "runs" / "g").iterdir()) == ["notes.txt"]  # nothing written there
    assert (work / "runs" / "g" / "final").is_dir() and (work / "runs" / "g" / "checkpoint-3").is_dir()
    said = [line for line in capsys.readouterr().err.splitlines() if "changed the working directory" in line]
    assert len(said) == 2 and all(str(elsewhere) in m for m in said), said  # the import and the calls, once each


def test_a_reward_that_edits_its_arguments_in_place_changes_nothing_trained(tmp_path, monkeypatch):
    (tmp_path / "edit.py").write_text(
        "def fn(prompts, completions, completion_ids, answer, **kwargs):\n"
        "    for ids in completion_ids:\n"
        "        ids[:] = [7] * len(ids)\n"
        "    for p in prompts:\n"
        "        p[0]['content'] = 'edited'\n"
        "    answer[:] = ['edited'] * len(answer)\n"
        "    return [1.0] * len(completions)\n"
    )
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(4, seed=random.randrange(99))))
    sampled, trained, given = [], [], []
    real_sample, real_pack, real_score = (
        grpo_rollouts.sample_groups,
        grpo_rollouts.pack_completions,
        grpo_rollouts.score,
    )

    def sample(*args, **kwargs):
        groups = real_sample(*args, **kwargs)
        sampled.extend([list(r.ids) for r in g] for g in groups)
        return groups

    def pack(comps, *args, **kwargs):
        trained.extend(comps)
        return real_pack(comps, *args, **kwargs)

    def scored(funcs, prompts, *args, **kwargs):
        given.append(json.dumps(prompts))
        out = real_score(funcs, prompts, *args, **kwargs)
        given.append(json.dumps(prompts))
        return out

    monkeypatch.setattr(grpo_rollouts, "sample_groups", sample)
    monkeypatch.setattr(grpo_rollouts, "pack_completions", pack)
    monkeypatch.setattr(grpo_rollouts, "score", scored)
    rc = main(grpo_argv(str(tmp_path / "data.jsonl"), f"{tmp_path / 'edit.py'}:fn", str(tmp_path / "run"),
                        "--max_steps", "3"))  # fmt: skip
    assert rc == 0
    flat = [ids for groups in sampled for ids in groups]
    assert len(trained) == len(flat) > 0
    for comp, ids in zip(trained, flat):
        assert comp.input_ids[-len(ids) :] == ids and set(comp.loss_mask[-len(ids) :]) == {1}
    assert given[0] == given[1] and "edited" not in "".join(given)


class Custom(BaseException):
    pass


@pytest.mark.parametrize("raised", [GeneratorExit, Custom])
def test_a_reward_that_raises_a_base_exception_is_one_line(raised):
    def fn(completions, **kwargs):
        if any("bad" in c for c in completions):
            raise raised("no")
        return [0.0] * len(completions)

    where = [f"d.jsonl:{i + 1}" for i in range(3)]
    with pytest.raises(RewardError, match=rf"reward function 'f' raised {raised.__name__}: no on row d.jsonl:2 "):
        score([RewardFunc("f", fn)], ["q"] * 3, ["ok", "bad", "ok"], [[1], [2], [3]], {}, where)

    def interrupted(completions, **kwargs):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C still stops the run
        score([RewardFunc("f", interrupted)], ["q"], ["ok"], [[1]], {}, where)


def test_a_base_exception_from_a_reward_file_ends_the_run_in_one_line(tmp_path, error_line):
    (tmp_path / "r.py").write_text("class Stop(BaseException):\n    pass\n\ndef fn(**kwargs):\n    raise Stop('x')\n")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(2, seed=1)))
    line = error_line(grpo_argv(str(tmp_path / "data.jsonl"), f"{tmp_path / 'r.py'}:fn", str(tmp_path / "run"),
                                "--max_steps", "1"))  # fmt: skip
    assert "raised Stop: x on row" in line and "data.jsonl:1" in line, line


def test_a_step_whose_completions_are_all_truncated_and_masked_says_so(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(4, seed=3)))
    argv = grpo_argv(str(tmp_path / "data.jsonl"), "format", str(tmp_path / "run"), "--max_steps", "2",
                     "--max_completion_length", "1", "--mask_truncated_completions", "true")  # fmt: skip
    assert main(argv) == 0
    said = [
        line.partition("WARNING ")[2] for line in capsys.readouterr().err.splitlines() if "every completion" in line
    ]
    assert [m.split(":")[0] for m in said] == ["step 1", "step 2"], said
    assert "trains nothing" in said[0] and "max_completion_length 1" in said[0]


def test_a_float_list_on_the_command_line_parses_as_a_b():
    weights = [round(random.uniform(-3, 3), 3) for _ in range(3)]
    argv = ["--reward_weights", ",".join(map(str, weights)), "--reward_funcs", "exact_answer,format,length_penalty"]
    cfg = load_config(None, parse_overrides(argv))
    assert cfg.reward_weights == weights and cfg.reward_funcs == ["exact_answer", "format", "length_penalty"]
    with pytest.raises(ConfigError, match=r"key 'reward_weights': expected list of float.*'1.0,x'"):
        load_config(None, parse_overrides(["--reward_weights", "1.0,x"]))


@pytest.mark.parametrize("readable", [True, False])
def test_each_call_comes_back_to_the_working_directory(tmp_path, monkeypatch, readable):
    """Called directly, with the working directory kept by an open descriptor, or by its path where it cannot be
    opened for reading (a directory this user may enter but not list)."""
    here, there = tmp_path / "here", tmp_path / f"there-{random.randrange(1 << 30)}"
    here.mkdir()
    there.mkdir()
    monkeypatch.chdir(here)
    if not readable:

        def refused(*args, **kwargs):
            raise PermissionError("not readable")

        monkeypatch.setattr(reward_fence.os, "open", refused)

    def moves(completions, **kwargs):
        os.chdir(there)
        return [1.0] * len(completions)

    got = score([RewardFunc(f"moves-{readable}", moves)], ["q"] * 2, ["a", "b"], [[1], [2]], {}, ["d:1", "d:2"])
    assert got.tolist() == [[1.0], [1.0]] and os.getcwd() == str(here)


def test_a_reward_without_kwargs_is_told_what_it_is_given():
    def strict(prompts, completions, completion_ids):
        return [0.0] * len(completions)

    with pytest.raises(
        RewardError, match=r"unexpected keyword argument .*a reward takes \*\*kwargs, as TRL .*\['answer'\]"
    ):
        score([RewardFunc("strict", strict)], ["q"], ["a"], [[1]], {"answer": ["1"]}, ["d:1"])


def test_a_column_named_as_a_reward_keyword_is_one_line(tmp_path, error_line):
    name = random.choice(["prompts", "completions", "completion_ids", "trainer_state"])
    (tmp_path / "data.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2", name: "x"}) + "\n")
    line = error_line(
        grpo_argv(str(tmp_path / "data.jsonl"), "exact_answer", str(tmp_path / "run"), "--max_steps", "1")
    )
    assert "data.jsonl:1" in line and f"column '{name}' has the name of a keyword" in line, line
