"""Fixtures of the security tests: a tiny Qwen3.5 model directory per test module, the one error line of a
command that must fail with exit code 2 (never a traceback), and a run stopped after its first step to resume."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest
from resumes import interrupted, keys

from checkpoints import make_checkpoint
from hybridtune.cli import main


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
