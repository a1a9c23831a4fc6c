"""The example configs shipped in hybridtune/configs/ (package data): one for each job the README names, each read by
the config loader as `hybridtune train NAME` reads it, listed by `hybridtune doctor` with what it is for, and each
trained a few steps on a tiny model (a real checkpoint's swapped for the tiny preset, `my_chats.jsonl` for small chats)."""

from __future__ import annotations

import logging

import pytest

from hybridtune.config import bundled_configs, load_config
from hybridtune.infer import vl_demo
from hybridtune.kernels import doctor
from hybridtune.run.plots import ACCURACY_PLOT, LOSS_PLOT, REWARD_PLOT
from train_runs import run

SHIPPED = bundled_configs()
# Each job of the README and what makes a config its example.
JOBS = {
    "text SFT": lambda c: c.objective == "sft" and c.adapter == "lora" and not c.load_in_4bit,
    "images": lambda c: "vl" in c.base_model and c.objective == "sft",
    "preference (dpo, simpo, orpo)": lambda c: c.objective in ("dpo", "simpo", "orpo"),
    "grpo": lambda c: c.objective == "grpo" and bool(c.reward_funcs),
    "qlora": lambda c: c.load_in_4bit,
    "8-bit optimizer": lambda c: c.optim == "adamw_8bit",
    "tensorboard": lambda c: c.report_to == "tensorboard",
    "wandb": lambda c: c.report_to == "wandb",
}


def test_every_job_has_an_example_config():
    configs = {name: load_config(name) for name in SHIPPED}
    missing = [job for job, fits in JOBS.items() if not any(fits(c) for c in configs.values())]
    assert not missing, f"no example config for {missing}"
    assert all((f := str(path)).endswith(".yaml") and "/hybridtune/configs/" in f for path in SHIPPED.values())


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_each_loads_by_its_name_as_train_reads_it_and_warns_of_nothing(name, caplog):
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        cfg = load_config(name)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert cfg == load_config(SHIPPED[name])
    text = SHIPPED[name].read_text(encoding="utf-8")
    assert f"hybridtune train {name}" in text  # the command that runs it, in its own comment
    assert text.startswith("# ") and len(text.splitlines()[0]) <= 120


def test_doctor_lists_each_with_what_it_is_for(capsys):
    assert doctor.main([]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, path in SHIPPED.items():
        (i,) = [i for i, line in enumerate(lines) if line.split()[:1] == [name]]
        assert lines[i].split() == [name, str(path)]
        about = path.read_text(encoding="utf-8").splitlines()[0].removeprefix("# ")
        assert lines[i + 1].strip() == about


# name -> (overrides for a few steps on a tiny model, the curves its run draws)
TRAINED = {
    "arithmetic-lora.yaml": ({}, [LOSS_PLOT]),
    "arithmetic-dpo.yaml": ({"base_model": "tiny-qwen3_5"}, [LOSS_PLOT, ACCURACY_PLOT]),
    "arithmetic-grpo.yaml": (
        {"base_model": "tiny-qwen3_5", "num_generations": 2, "micro_batch_size": 2, "max_completion_length": 4},
        [LOSS_PLOT, REWARD_PLOT],
    ),
    "qwen3_5-qlora.yaml": ({"base_model": "tiny-qwen3_5", "gradient_accumulation_steps": 1}, [LOSS_PLOT]),
    "qwen3_5-full-8bit.yaml": (
        {"base_model": "tiny-qwen3_5", "gradient_accumulation_steps": 1, "report_to": "none"},
        [LOSS_PLOT],
    ),
    "shapes-vl.yaml": ({}, [LOSS_PLOT]),
}


def test_every_example_is_trained_below():
    assert {f"hybridtune:configs/{n}" for n in TRAINED} == set(SHIPPED)


SLOW = {"qwen3_5-full-8bit.yaml"}  # torchao's 8-bit AdamW compiles its step on the CPU: minutes


@pytest.mark.parametrize("file", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f for f in sorted(TRAINED)])
def test_each_example_trains_a_few_steps(file, tmp_path, small_data, monkeypatch):
    monkeypatch.chdir(tmp_path)  # its relative paths (outputs/, demo/) are the working directory's
    keys, plots = TRAINED[file]
    name = f"hybridtune:configs/{file}"
    if "my_chats.jsonl" in SHIPPED[name].read_text(encoding="utf-8"):
        keys = {**keys, "dataset": small_data}
    if file == "shapes-vl.yaml":
        assert vl_demo.main([str(tmp_path / "demo"), "--train", "12", "--test", "2"]) == 0
    out = tmp_path / "out"
    cfg = load_config(name, {**keys, "max_steps": 2, "output_dir": str(out), "logging_steps": 1, "save_steps": 0,
                             "eval_steps": 0, "val_set_size": 0, "sequence_len": 128})  # fmt: skip
    res = run(cfg)
    assert res.steps == 2 and res.final_dir and len(res.losses) == 2
    assert all((out / p).is_file() for p in plots), sorted(p.name for p in out.iterdir())
