"""Fixtures of the security tests: a tiny Qwen3.5 model directory per test module, the one error line of a
command that must fail with exit code 2 (never a traceback), a run stopped after its first step to resume, a
finished two-step LoRA run (and a copy of it to damage), and the tiny vision-language tokenizer and `Vision`
(tests/vl_fixtures.py, shared with tests/data/vision)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from resumes import interrupted, keys, lora_run

from checkpoints import make_checkpoint
from hybridtune.cli import main
from vl_fixtures import tok, vision  # noqa: F401  (the fixtures, taken by this folder's tests)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random qwen3_5_text model directory, shared by the tests of one module."""
    return make_checkpoint(tmp_path_factory.mktemp("security"), "qwen3_5_text", name="model")


@pytest.fixture
def error_line(capsys) -> Callable[[list[str]], str]:
    """`error_line(argv)`: the one `error:` line of `hybridtune argv`, which must exit 2 without a traceback."""

    def run(argv: list[str]) -> str:
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == 2, err
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(lines) == 1, err
        return lines[0]

    return run


@pytest.fixture(scope="module")
def stopped(tmp_path_factory, small_data):
    """A full fine-tune of the tiny preset with torch's AdamW (fp32 on the CPU) stopped after step 1, once per test
    module; each test edits a copy (`copied`)."""
    out = tmp_path_factory.mktemp("stopped") / "run"
    interrupted(out, small_data)
    return out, small_data


@pytest.fixture
def copied(stopped, tmp_path):
    """(output_dir, the run's keys) of a copy of `stopped`."""
    out = tmp_path / "run"
    shutil.copytree(stopped[0], out)
    return out, keys(out, stopped[1])


@pytest.fixture(scope="session")
def lora_run_dir(tmp_path_factory, small_data) -> Path:
    """A finished two-step LoRA run of the default preset: checkpoint-2/, final/ (the adapter), base_model/. Tests
    only read it; `lora_run_copy` is theirs to damage."""
    out = tmp_path_factory.mktemp("lora-run") / "run"
    assert main(lora_run(small_data, out)) == 0
    return out


@pytest.fixture
def lora_run_copy(lora_run_dir, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(lora_run_dir, out)
    return out
