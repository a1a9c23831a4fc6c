"""report_to with a tracker package that is installed but broken (it raises at import: a mismatched protobuf, a
half-upgraded dependency): one line naming the tracker, the exception and what to do, exit 2 at setup, before any
step. Each test plants a fake package on sys.path that raises when imported."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.train.trackers import open_tracker


def plant(monkeypatch, tmp_path: Path, name: str, body: str) -> None:
    """A package `name` on sys.path, ahead of the real one, whose import runs `body`; any imported copy forgotten."""
    pkg = tmp_path / "planted" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path / "planted"))
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, mod)
    if name == "tensorboard":  # torch's wrapper imports tensorboard once: forget it too
        for mod in [m for m in sys.modules if m.startswith("torch.utils.tensorboard")]:
            monkeypatch.delitem(sys.modules, mod)


def assert_one_line(msg: str, name: str, *needles: str) -> None:
    assert "\n" not in msg, msg
    assert f"'report_to' = '{name}'" in msg and "report_to: none" in msg and "force-reinstall" in msg, msg
    assert "not installed" not in msg, msg  # it is installed: it is broken
    for n in needles:
        assert n in msg, msg


@pytest.mark.parametrize(
    "body,kind",
    [
        ("raise RuntimeError('protobuf descriptors cannot be created directly')", "RuntimeError"),
        ("raise AttributeError(\"module 'google.protobuf' has no attribute 'x'\")", "AttributeError"),
        ("raise ImportError(\"cannot import name 'builder' from 'google.protobuf.internal'\")", "ImportError"),
        ("raise TypeError('Descriptors cannot be created directly.\\nMore details on line two')", "TypeError"),
    ],
)
def test_a_broken_wandb_is_one_line(monkeypatch, tmp_path, body, kind):
    plant(monkeypatch, tmp_path, "wandb", body)
    cfg = load_config(None, {"report_to": "wandb", "output_dir": str(tmp_path / "out")})
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError) as e:
        open_tracker(cfg, tmp_path / "out", True, 0)
    assert_one_line(str(e.value), "wandb", f"failed with {kind}")
    assert not (tmp_path / "out" / "runs" / "run.wandb-id").exists()


def test_a_broken_tensorboard_is_one_line(monkeypatch, tmp_path):
    plant(monkeypatch, tmp_path, "tensorboard", "raise RuntimeError('a broken install')")
    cfg = load_config(None, {"report_to": "tensorboard", "output_dir": str(tmp_path / "out")})
    (tmp_path / "out").mkdir()
    with pytest.raises(ConfigError) as e:
        open_tracker(cfg, tmp_path / "out", True, 0)
    assert_one_line(str(e.value), "tensorboard", "failed with RuntimeError: a broken install")


def test_train_with_a_broken_wandb_exits_2_before_any_step(monkeypatch, tmp_path, small_data, capsys):
    plant(monkeypatch, tmp_path, "wandb", "raise RuntimeError('protobuf is broken')")
    out = tmp_path / "run"
    args = ["--dataset", small_data, "--sequence_len", "64", "--max_steps", "2", "--warmup_steps", "1"]
    capsys.readouterr()
    rc = main(["train", *args, "--report_to", "wandb", "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("error: ") and sum(x.startswith("error: ") for x in lines) == 1, err
    assert_one_line(lines[-1], "wandb", "failed with RuntimeError: protobuf is broken")
    assert not re.search(r"\bstep +1\b", err) and not (out / "final").exists(), err  # no step ran, nothing exported
