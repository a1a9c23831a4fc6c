"""Fixtures of the security tests: a tiny Qwen3.5 model directory per test module, and the one error line of a
command that must fail with exit code 2 (never a traceback)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

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
