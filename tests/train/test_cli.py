"""The real CLI: a few training steps end to end, and every bad input gives one line and exit code 2.

The end-to-end run starts a fresh interpreter (`python -m hybridtune`, slow tier); the bad-input checks call
`hybridtune.cli.main` in this process (what `python -m hybridtune` runs, minus the interpreter start), so each
costs what its check costs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridtune.cli import main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hybridtune", *args], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600
    )


@pytest.fixture
def cli_here(capsys):
    """`hybridtune ARGS` in this process: its exit code and output, as `cli` returns them."""

    def run(*args: str) -> subprocess.CompletedProcess:
        capsys.readouterr()
        rc = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["hybridtune", *args], rc, out, err)

    return run


@pytest.mark.slow  # a fresh interpreter trains and then refuses
def test_train_a_few_steps_then_refuse_a_different_run(tmp_path, small_data):
    out = tmp_path / "run"
    common = [
        "--dataset",
        small_data,
        "--adapter",
        "lora",
        "--sequence_len",
        "64",
        "--eval_steps",
        "3",
        "--logging_steps",
        "1",
        "--warmup_steps",
        "2",  # shorter than the run: no warning line before the refusal below
    ]
    r = cli("train", *common, "--max_steps", "6", "--output_dir", str(out))
    assert r.returncode == 0, r.stderr
    assert "step     6" in r.stderr and "exact_match" in r.stderr
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [x for x in recs if x["type"] == "train"]
    assert [x["step"] for x in train] == [1, 2, 3, 4, 5, 6]
    assert all(k in train[0] for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mem_gib"))
    assert (out / "final" / "adapter_model.safetensors").is_file() and (out / "checkpoint-6").is_dir()
    before = sorted(p.name for p in out.iterdir())

    # A different run into the same directory is refused, and nothing there is touched.
    r = cli("train", *common, "--max_steps", "6", "--lora_r", "4", "--output_dir", str(out))
    assert r.returncode == 2
    assert (
        r.stderr.strip().count("\n") == 0
        and "already holds a finished run of another config (lora_r: 16 -> 4)" in r.stderr
    )
    assert sorted(p.name for p in out.iterdir()) == before


def one_line_error(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    # Progress logs may come first; the error itself is one line, and the last one.
    assert len(errors) == 1 and lines[-1] == errors[0], r.stderr
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.mark.parametrize(
    "content,needles",
    [
        (None, ["does not exist"]),
        ('{"text": "a"}\n{"text": \n', [":2: malformed JSON"]),
        ('{"instruction": "a"}\n', [":1:", "no field 'output'"]),
        ("\n", ["has no rows"]),
        ('{"text": "a sentence of several tokens"}\n', ["no training examples left"]),  # longer than seq 2: dropped
    ],
)
def test_bad_data_is_one_line(tmp_path, cli_here, content, needles):
    path = tmp_path / "d.jsonl"
    if content is not None:
        path.write_text(content)
    args = ["train", "--dataset", str(path), "--output_dir", str(tmp_path / "o"), "--val_set_size", "0"]
    if content == '{"instruction": "a"}\n':
        args += ["--dataset_type", "alpaca"]
    if content and "several" in content:
        args += ["--sequence_len", "2", "--excess_length_strategy", "drop"]
    one_line_error(cli_here(*args), *needles)


def test_bad_config_is_one_line(tmp_path, cli_here, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty directory, so the default output_dir holds no earlier run
    run = cli_here

    one_line_error(run("train", "--lora_rnk", "4"), "did you mean 'lora_r'")
    one_line_error(run("train", "--sequence_len", "1"), "sequence_len", "at least 2")
    one_line_error(run("train", "--micro_batch_size", "two"), "micro_batch_size", "expected int")
    one_line_error(run("train", "--base_model", "tiny-qwen35"), "Did you mean preset 'tiny-qwen3_5'")
    one_line_error(run("train", str(tmp_path / "nope.yaml")), "nope.yaml", "does not exist")
    one_line_error(run("trian"), "Did you mean 'train'")
    assert not os.listdir(tmp_path)  # a refused run writes nothing


def test_foreign_output_dir_is_refused(tmp_path, small_data, cli_here):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("precious")
    one_line_error(cli_here("train", "--dataset", small_data, "--output_dir", str(out)), "--overwrite")
    assert (out / "notes.txt").read_text() == "precious" and sorted(os.listdir(out)) == ["notes.txt"]


def test_help_lists_keys():
    r = cli("train", "--help")  # `python -m hybridtune` itself, in the fast tier: the help needs no torch import
    assert r.returncode == 0 and "--gradient_accumulation_steps" in r.stdout and "--resume_from_checkpoint" in r.stdout
