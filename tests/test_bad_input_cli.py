"""Bad paths given to `compile --check` and `--tokenizer`: one line, exit 2, before any work is done."""

from __future__ import annotations

import pytest

from hybridtune.cli import main
from hybridtune.errors import ModelError


def test_compile_check_of_a_missing_directory(tmp_path, capsys):
    missing = tmp_path / "no-dump"
    assert main(["compile", "--family", "qwen3_5", "--check", str(missing)]) == 2
    out = capsys.readouterr()
    err = out.err.strip().splitlines()
    assert len(err) == 1 and f"--check '{missing}' is not a directory" in err[0], err
    assert "Qwen3_5" not in out.out  # refused before the plan is generated and printed
    f = tmp_path / "afile"
    f.write_text("x")
    assert main(["compile", "--family", "qwen3_5", "--check", str(f)]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_empty_tokenizer_directory(tmp_path):
    from hybridtune.models.loading import tokenizer_for

    empty = tmp_path / "tok"
    empty.mkdir()
    with pytest.raises(ModelError, match=r"'.*tok' holds no loadable tokenizer \(.*\); give a tokenizer directory"):
        tokenizer_for("tiny-qwen3_5", str(empty))
    (empty / "tokenizer_config.json").write_text("{garbled")
    with pytest.raises(ModelError, match=r"'.*tok' holds no loadable tokenizer \(.*\); give a tokenizer directory"):
        tokenizer_for("tiny-qwen3_5", str(empty))


@pytest.mark.slow  # a fresh interpreter
def test_help_into_a_closed_pipe_is_no_traceback():
    """`hybridtune train --help | head -2` printed a BrokenPipeError traceback once head had its lines."""
    import subprocess
    import sys

    proc = subprocess.run(
        f"{sys.executable} -m hybridtune train --help | head -2", shell=True, capture_output=True, text=True
    )
    assert proc.stdout.count("\n") == 2 and proc.stderr == "", proc.stderr
