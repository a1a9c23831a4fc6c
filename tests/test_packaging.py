"""The wheel carries what hybridtune reads from its own package at run time: the bundled data, tokenizer and
example configs (pyproject's package-data), and they resolve from an installed copy as from the source tree."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a wheel build and a fresh interpreter: a few seconds on 2 cores
def test_wheel_ships_package_data_and_the_configs_resolve_from_it(tmp_path):
    src = tmp_path / "src-copy"  # a copy: an in-tree build would leave build/ in the checkout
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert build.returncode == 0, build.stderr
    (wheel,) = out.glob("hybridtune-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = sorted(p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src/hybridtune/configs").glob("*.yaml"))
    assert "hybridtune/configs/arithmetic-lora.yaml" in shipped and set(shipped) <= names
    assert "hybridtune/data/sample/arithmetic.jsonl" in names
    assert {"hybridtune/models/tokenizer/tokenizer.json", "hybridtune/models/tokenizer/chat_template.jinja"} <= names

    # Installed (the wheel unpacked on sys.path, no source tree): the bundled config loads by its name.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import hybridtune.config as c\n"
        "cfg = c.load_config('hybridtune:configs/arithmetic-lora.yaml', {'output_dir': 'o'})\n"
        "print(c.__file__, cfg.adapter, cfg.lora_r)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr
    where, adapter, rank = r.stdout.split()
    assert Path(where).is_relative_to(site) and (adapter, rank) == ("lora", "16")
