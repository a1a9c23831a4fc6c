"""GRPO's reward functions at their edges: the reward file is part of the run's identity (its sha256 in the run
record: a resume after an edit, or from a directory where the path names another file, is refused in one line),
numbers too large for a float, numpy scalars and 0-d tensors (accepted) and multi-element ones (refused), rewards
that overflow once weighted and normalised, and sys.exit from a reward: each one line naming the function and the row
(exit 2), with the steps done kept; Ctrl-C's KeyboardInterrupt from a reward still stops the run as Ctrl-C does."""

from __future__ import annotations

import hashlib
import json
import re
import sys
import textwrap

import pytest
import torch

from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.errors import ConfigError, OutputDirError
from hybridtune.run import outdir
from hybridtune.train.objectives import rewards
from hybridtune.train.objectives.rewards import RewardError, load_reward_funcs, score
from train_runs import record_run

USER = textwrap.dedent(
    """
    import sys
    import numpy as np
    import torch

    def huge(completions, **kwargs):
        return [10**400 for _ in completions]

    def numpy_and_tensors(completions, **kwargs):
        return [np.float32(0.5), np.int64(2), torch.tensor(1.5, dtype=torch.bfloat16), np.array(-3.0), None][
            : len(completions)
        ]

    def a_vector(completions, **kwargs):
        return [torch.tensor([0.5, 1.0]) for _ in completions]

    def an_array(completions, **kwargs):
        return [np.array([0.5, 1.0]) for _ in completions]

    def a_bool(completions, **kwargs):
        return [np.bool_(True) for _ in completions]

    def exits(completions, **kwargs):
        sys.exit(0)

    def interrupts(completions, **kwargs):
        raise KeyboardInterrupt
    """
)


def call(funcs, completions):
    n = len(completions)
    where = [f"data.jsonl:{i + 1}" for i in range(n)]
    return score(funcs, ["q"] * n, completions, [[1, 2]] * n, {"answer": ["0"] * n}, where)


@pytest.fixture
def user_file(tmp_path, monkeypatch):
    (tmp_path / "edge_rewards.py").write_text(USER)
    monkeypatch.chdir(tmp_path)
    return "edge_rewards.py"


def test_an_int_too_large_for_a_float_is_one_line(user_file):
    funcs = load_reward_funcs([f"{user_file}:huge"], 8)
    with pytest.raises(RewardError) as e:
        call(funcs, ["a", "b"])
    msg = str(e.value)
    assert msg.startswith("reward function 'edge_rewards.py:huge' returned 1000") and "\n" not in msg
    assert "(401 characters) (too large for a float) for completion 0 of row data.jsonl:1" in msg, msg


def test_numpy_scalars_and_0d_tensors_are_numbers(user_file):
    funcs = load_reward_funcs([f"{user_file}:numpy_and_tensors"], 8)
    got = call(funcs, ["a", "b", "c", "d", "e"])
    assert got[:, 0].tolist() == [0.5, 2.0, 1.5, -3.0, 0.0]  # (None: no reward, 0)


@pytest.mark.parametrize(
    "name,shown",
    [("a_vector", "tensor([0.5000, 1.0000])"), ("an_array", "array([0.5, 1. ])"), ("a_bool", "np.True_")],
)
def test_a_multi_element_tensor_or_array_or_a_bool_stays_refused(user_file, name, shown):
    funcs = load_reward_funcs([f"{user_file}:{name}"], 8)
    with pytest.raises(RewardError) as e:
        call(funcs, ["a", "b"])
    msg = str(e.value)
    assert msg.startswith(f"reward function 'edge_rewards.py:{name}' returned {shown} for completion 0 of row "
                          "data.jsonl:1; it must return a finite number") and "\n" not in msg, msg  # fmt: skip


def test_sys_exit_in_a_reward_is_one_line_and_ctrl_c_passes(user_file, tmp_path):
    funcs = load_reward_funcs([f"{user_file}:exits"], 8)
    with pytest.raises(RewardError, match=r"^reward function 'edge_rewards.py:exits' raised SystemExit \(sys.exit\(0\) "
                       r"would end the run as if it had finished\) on row data.jsonl:1 \(completion 0\)$"):  # fmt: skip
        call(funcs, ["a", "b"])
    with pytest.raises(KeyboardInterrupt):  # what Ctrl-C raises: the trainer's own handling (save, exit 130)
        call(load_reward_funcs([f"{user_file}:interrupts"], 8), ["a", "b"])
    (tmp_path / "exits_on_import.py").write_text("import sys\nsys.exit(3)\ndef f(completions, **kw): ...\n")
    with pytest.raises(ConfigError, match=r"importing exits_on_import.py raised SystemExit \(sys.exit\(3\)"):
        load_reward_funcs(["exits_on_import.py:f"], 8)


def _rewards(*columns):
    return torch.tensor(list(zip(*columns)), dtype=torch.float64)


def test_rewards_that_overflow_once_weighted_or_normalised_are_one_line():
    a, b = rewards.RewardFunc("a.py:big", None), rewards.RewardFunc("small", None)
    where = ["d.jsonl:1", "d.jsonl:1", "d.jsonl:2", "d.jsonl:2"]
    ok = rewards.total_rewards([a, b], _rewards([1.0, 2.0, 3.0, 4.0], [0.5] * 4), [2.0, 1.0], 2, where)
    assert ok.tolist() == [2.5, 4.5, 6.5, 8.5]
    cases = [
        # the group's std: (1e308 - 0)^2 overflows although every reward and their mean are finite
        ([[1.0, 1.0, 1e308, -1e308], [0.0] * 4], None, "group", "'a.py:big'", "d.jsonl:2 (completion 2)"),
        # the group's mean: 1e308 + 1e308 (both functions' rewards large: both named)
        ([[1e308, 1e308, 0.0, 0.0], [1e200] * 4], None, "group", "'a.py:big', 'small'", "d.jsonl:1 (completion 0)"),
        # weighted: 1e308 x 2 is inf
        ([[1.0, 1e308, 1.0, 1.0], [0.0] * 4], [2.0, 1.0], "group", "'a.py:big'", "d.jsonl:1 (completion 0)"),
        # scale_rewards batch: the step's std (each group's is 0)
        ([[1e200, 1e200, -1e200, -1e200], [0.0] * 4], None, "batch", "'a.py:big'", "d.jsonl:1 (completion 0)"),
    ]
    for columns, weights, scale, names, row in cases:
        with pytest.raises(RewardError) as e:
            rewards.total_rewards([a, b], _rewards(*columns), weights, 2, where, scale)
        msg = str(e.value)
        assert msg.startswith(f"reward function{'s' if ',' in names else ''} {names} returned rewards that overflow")
        assert f"those of row {row} are not finite" in msg and "\n" not in msg, msg
    # the same rewards under scale_rewards group: each group's std is 0, nothing overflows
    same = rewards.total_rewards([a, b], _rewards(*cases[3][0]), None, 2, where)
    assert same.tolist() == [1e200, 1e200, -1e200, -1e200]


def _grpo_cfg(out, **kw):
    return load_config(None, {"objective": "grpo", "dataset": "prompts.jsonl", "output_dir": str(out),
                              "reward_funcs": ["rw.py:r", "exact_answer"], **kw})  # fmt: skip


def test_the_reward_file_is_part_of_the_runs_identity(tmp_path, monkeypatch):
    """Its sha256 is in the run record; a resume after an edit is refused naming the file (--overwrite accepts it);
    the same content from another directory is the same run; a record from before reward files were recorded is not
    compared on them."""
    here, there = tmp_path / "here", tmp_path / "there"
    for d in (here, there):
        d.mkdir()
        (d / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
        (d / "rw.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    out = tmp_path / "run"
    monkeypatch.chdir(here)
    cfg = _grpo_cfg(out)
    record = outdir.run_record(cfg)
    assert record["data"]["rw.py"] == hashlib.sha256((here / "rw.py").read_bytes()).hexdigest()
    record_run(out, cfg)
    resume = _grpo_cfg(out, resume_from_checkpoint="latest")
    assert outdir.check_output_dir(resume) is False  # the same run
    (here / "rw.py").write_text("def r(completions, **kw):\n    return [-1.0] * len(completions)\n")
    with pytest.raises(OutputDirError) as e:
        outdir.check_output_dir(resume)
    assert str(e.value) == (
        "resume_from_checkpoint: the config differs from the run it continues (reward file rw.py changed since that "
        "run); resume with the run's own config, or pass --overwrite to continue under the new one"
    )
    assert outdir.check_output_dir(_grpo_cfg(out, resume_from_checkpoint="latest", overwrite=True)) is False
    monkeypatch.chdir(there)  # the same relative path, the original content: the same run
    assert outdir.check_output_dir(resume) is False
    (there / "rw.py").write_text("def r(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(OutputDirError, match=r"\(reward file rw.py changed since that run\)"):
        outdir.check_output_dir(resume)
    held = json.loads((out / outdir.RUN_FILE).read_text())
    del held["data"]["rw.py"]  # a run recorded before its reward files were
    (out / outdir.RUN_FILE).write_text(json.dumps(held))
    assert outdir.check_output_dir(resume) is False


def test_a_run_recorded_before_reward_files_were_keeps_the_same_data_under_another_path(tmp_path, monkeypatch):
    """A record without the reward file's hash (from before they were recorded) of data named by an absolute path,
    resumed with the same file named relatively: the same data, as for any run (no 'dataset' change, no false
    'data file changed'); data really changed is still named; a reward file named by another path in a record that
    has reward hashes stays the same data (only reward_funcs differs)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    (tmp_path / "rw.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    out = tmp_path / "run"
    held = outdir.run_record(_grpo_cfg(out, dataset=str(tmp_path / "prompts.jsonl")))
    old = {**held, "data": {k: v for k, v in held["data"].items() if k != "rw.py"}}
    assert list(old["data"]) == [str(tmp_path / "prompts.jsonl")]
    cfg = _grpo_cfg(out)
    assert outdir.changes(old, cfg, (), outdir.data_fingerprint(cfg)) == []
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    assert outdir.changes(old, cfg, (), outdir.data_fingerprint(cfg)) == [
        f"dataset: '{tmp_path / 'prompts.jsonl'}' -> 'prompts.jsonl'",
        "data file prompts.jsonl changed since that run",
    ]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    moved = _grpo_cfg(out, reward_funcs=[f"{tmp_path / 'rw.py'}:r", "exact_answer"])
    assert outdir.changes(held, moved, (), outdir.data_fingerprint(moved)) == [
        f"reward_funcs: ['rw.py:r', 'exact_answer'] -> ['{tmp_path / 'rw.py'}:r', 'exact_answer']"
    ]


def test_an_edited_reward_file_in_the_same_process_is_the_new_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rw.py").write_text("def r(completions, **kw):\n    return [1.0] * len(completions)\n")
    assert call(load_reward_funcs(["rw.py:r"], 8), ["a"]).tolist() == [[1.0]]
    (tmp_path / "rw.py").write_text("def r(completions, **kw):\n    return [2.0] * len(completions)\n")
    assert call(load_reward_funcs(["rw.py:r"], 8), ["a"]).tolist() == [[2.0]]


EAGER = textwrap.dedent(
    """
    import sys
    from dataclasses import dataclass
    from typing import ClassVar


    @dataclass
    class Scale:
        unit: ClassVar[float] = 1.0
        bonus: float = 0.5


    def typed(x: Scale) -> float:
        return x.bonus


    def r(completions, **kwargs):
        assert typed.__annotations__["x"] is Scale, typed.__annotations__  # evaluated, not the string 'Scale'
        return [Scale.unit + Scale().bonus for _ in completions]


    MODULE = sys.modules[__name__]
    """
)


def test_a_reward_file_runs_as_its_own_module_not_under_rewards_py_future_imports(tmp_path, monkeypatch):
    """A dataclass with a ClassVar field and annotations read as classes: the file is compiled with its own future
    flags only (not rewards.py's `from __future__ import annotations`) and is in sys.modules while it runs, as an
    import would have it; a file that fails to import (or is stopped by Ctrl-C) leaves no module behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eager.py").write_text(EAGER)
    (fn,) = load_reward_funcs(["eager.py:r"], 8)
    assert call([fn], ["a", "b"]).tolist() == [[1.5], [1.5]]
    module = sys.modules[fn.fn.__module__]
    assert module.MODULE is module and module.typed.__annotations__ == {"x": module.Scale, "return": float}
    (tmp_path / "broken.py").write_text("import sys\nSEEN = sys.modules[__name__]\nraise ValueError('no')\n")
    before = set(sys.modules)
    with pytest.raises(ConfigError, match=r"importing broken.py raised ValueError: no$"):
        load_reward_funcs(["broken.py:r"], 8)
    assert set(sys.modules) == before
    (tmp_path / "stopped.py").write_text("raise KeyboardInterrupt\n")  # Ctrl-C while it imports: passes, no module
    with pytest.raises(KeyboardInterrupt):
        load_reward_funcs(["stopped.py:r"], 8)
    assert set(sys.modules) == before


# -- through `hybridtune train` on the tiny preset ------------------------------------------------------------------

LATE = """
import sys
calls = []
def r(completions, **kwargs):
    calls.append(1)
    if len(calls) > 1:
        {late}
    return [float(len(c)) for c in completions]
"""


def _train(tmp_path, monkeypatch, capsys, late: str, *extra: str) -> tuple[int, str]:
    """`hybridtune train` (3 steps of 2 prompts x 2 completions) with `late.py:r`, which runs `late` from its second
    call on, when `late` is given; (exit code, the last line on stderr)."""
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(4)]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if late:
        (tmp_path / "late.py").write_text(LATE.format(late=late))
    code = main(["train", "--objective", "grpo", "--dataset", "p.jsonl", "--output_dir", "run", "--max_steps", "3",
                 "--num_generations", "2", "--max_completion_length", "3", "--reward_funcs", "late.py:r",
                 "--val_set_size", "0", "--micro_batch_size", "2", *extra])  # fmt: skip
    return code, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "late,line",
    [
        ("sys.exit(0)", "error: reward function 'late.py:r' raised SystemExit (sys.exit(0) would end the run as if it "
         "had finished) on row p.jsonl:<row> (completion 0)"),
        ("return [1e308 if i % 2 else -1e308 for i in range(len(completions))]", "error: reward function 'late.py:r' "
         "returned rewards that overflow (largest weighted 1e+308): weighted, summed and normalised (mean, std), those "
         "of row p.jsonl:<row> (completion 0) are not finite; return rewards of an ordinary size (e.g. within +-1e6)"),
    ],
)  # fmt: skip
def test_sys_exit_or_overflowing_rewards_mid_run_stop_with_one_line_and_keep_the_steps_done(
    tmp_path, monkeypatch, capsys, late, line
):
    code, last = _train(tmp_path, monkeypatch, capsys, late)
    assert code == 2 and re.fullmatch(re.escape(line).replace("<row>", r"\d"), last), last  # (the rows are shuffled)
    assert (tmp_path / "run" / "checkpoint-1" / "checkpoint.json").is_file()  # step 1 kept
    assert not (tmp_path / "run" / "final").exists()


def test_ctrl_c_inside_a_reward_still_saves_and_exits_130(tmp_path, monkeypatch, capsys):
    code, last = _train(tmp_path, monkeypatch, capsys, "raise KeyboardInterrupt")
    assert code == 130 and last.endswith(  # (output_dir is made absolute at load: config.cross.absolute_paths)
        f"WARNING interrupted: saved {tmp_path / 'run' / 'checkpoint-1'}; continue with --resume_from_checkpoint latest"
    ), last
    assert (tmp_path / "run" / "checkpoint-1" / "checkpoint.json").is_file()


def test_a_resume_after_the_reward_file_was_edited_is_refused(tmp_path, monkeypatch, capsys):
    code, last = _train(tmp_path, monkeypatch, capsys, "raise RuntimeError('stop here')")
    assert code == 2 and "raised RuntimeError: stop here" in last and (tmp_path / "run" / "checkpoint-1").is_dir()
    (tmp_path / "late.py").write_text("def r(completions, **kwargs):\n    return [-1.0] * len(completions)\n")
    code, last = _train(tmp_path, monkeypatch, capsys, "", "--resume_from_checkpoint", "latest")
    assert (code, last) == (2, "error: resume_from_checkpoint: the config differs from the run it continues (reward "
                               "file late.py changed since that run); resume with the run's own config, or pass "
                               "--overwrite to continue under the new one")  # fmt: skip
    code, _ = _train(tmp_path, monkeypatch, capsys, "", "--resume_from_checkpoint", "latest", "--overwrite")
    assert code == 0 and (tmp_path / "run" / "final").is_dir()
    record = json.loads((tmp_path / "run" / outdir.RUN_FILE).read_text())
    assert record["data"]["late.py"] == hashlib.sha256((tmp_path / "late.py").read_bytes()).hexdigest()
