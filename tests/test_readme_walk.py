"""The README's quickstart, as a user with a hub checkpoint copies it: every command of its block run in a fresh
interpreter, in order, with the hub id swapped for a tiny checkpoint laid out in a hub cache (HF_HOME, offline) and
the checkpoint step (200) for one the tiny data reaches. Each must exit 0 and say nothing that looks like a fault
(transformers' fallback notices, a peft warning, a slow-path fix to make on a machine that has no faster path)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import fake_sha, hub_cache, make_checkpoint

README = Path(__file__).resolve().parents[1] / "README.md"
HUB_ID = "Qwen/Qwen3.5-0.8B"
# For the README's checkpoint-200: the tiny data's run (38 one-row bins, 2 epochs: 76 steps) saves step 40 and
# its last, the two checkpoints it keeps (save_total_limit).
STEP = 40
NOISE = ("falling back", "Could not find a config file", "hybridtune doctor", "Traceback", "UserWarning")


def quickstart() -> list[list[str]]:
    """The commands of the quickstart's bash block, continuation lines joined, comments dropped."""
    text = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def chats(n: int, start: int = 0) -> str:
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"What is {i}+{2 * i}?"},
                {"role": "assistant", "content": str(3 * i)},
            ]
        }
        for i in range(start, start + n)
    ]
    return "\n".join(json.dumps(r) for r in rows) + "\n"


def test_the_block_is_what_the_walk_runs():
    names = [c[1] for c in quickstart()]
    assert names == ["data", "train", "generate", "chat", "eval", "eval", "export", "merge"], names
    assert all(c[0] == "hybridtune" for c in quickstart())
    assert any(HUB_ID in c for c in quickstart()) and any("checkpoint-200" in " ".join(c) for c in quickstart())


@pytest.mark.slow
def test_the_readme_quickstart_runs_as_written(tmp_path):
    ckpt = make_checkpoint(tmp_path / "src", "qwen3_5_text")
    home = hub_cache(tmp_path, "acme/tiny-qwen", ckpt, fake_sha("main"))
    work = tmp_path / "walk"
    work.mkdir()
    (work / "my_chats.jsonl").write_text(chats(40))
    (work / "test_chats.jsonl").write_text(chats(6, start=100))
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "NO_COLOR": "1"}
    env.pop("HF_HUB_CACHE", None)
    times = []
    for argv in quickstart():
        argv = [re.sub(r"\b200\b", str(STEP), a.replace(HUB_ID, "acme/tiny-qwen")) for a in argv]
        stdin = "What is 7+5?\n/exit\n" if argv[1] == "chat" else None
        t = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "hybridtune", *argv[1:]], cwd=work, env=env, input=stdin, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip
        times.append((argv[1], time.perf_counter() - t))
        said = p.stdout + p.stderr
        assert p.returncode == 0, (argv, said[-3000:])
        assert not [n for n in NOISE if n in said], (
            argv,
            [ln for ln in said.splitlines() if any(n in ln for n in NOISE)],
        )
    run = json.loads((work / "outputs" / "chat-lora" / "hybridtune_run.json").read_text())
    assert run["config"]["adapter"] == "lora" and run["resolved"]["learning_rate"] == 2e-4
    assert (work / "outputs" / f"step-{STEP}" / "final" / "adapter_config.json").is_file()
    assert (work / "outputs" / "merged" / "config.json").is_file()
    print("readme walk:", ", ".join(f"{name} {s:.1f}s" for name, s in times), f"total {sum(s for _, s in times):.1f}s")
