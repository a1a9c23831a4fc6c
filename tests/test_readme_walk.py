"""The README as a user copies it. Its quickstart: every command of its block run in a fresh interpreter, in order,
as written but for the hub id, swapped for a tiny checkpoint laid out in a hub cache (HF_HOME, offline); each must
exit 0 and say nothing that looks like a fault (transformers' fallback notices, a peft warning, a slow-path fix to
make on a machine that has no faster path), and its export must find the checkpoint it names after
save_total_limit has removed the older ones. Its jobs: every `hybridtune train` line is a config the loader takes,
naming the job's example config, and the reward function it shows is one GRPO calls as written."""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoints import fake_sha, hub_cache, make_checkpoint
from hybridtune.config import bundled_configs, load_config, parse_overrides
from hybridtune.train.objectives.rewards import load_reward_funcs, score

README = Path(__file__).resolve().parents[1] / "README.md"
HUB_ID = "Qwen/Qwen3.5-0.8B"
NOISE = ("falling back", "Could not find a config file", "hybridtune doctor", "Traceback", "UserWarning")


def quickstart() -> list[list[str]]:
    """The commands of the quickstart's bash block, continuation lines joined, comments dropped."""
    text = README.read_text(encoding="utf-8").split("## Quickstart", 1)[1]
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in block.splitlines() if line.strip()]


def blocks(section: str) -> list[str]:
    """The fenced blocks (any language) of the README section whose heading starts with `section`."""
    text = README.read_text(encoding="utf-8").split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```\w*\n(.*?)^```$", text, re.M | re.S)


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


def test_the_readme_names_every_job_with_its_example_config(tmp_path, monkeypatch):
    text = README.read_text(encoding="utf-8")
    jobs = text.split("\n## Every job", 1)[1].split("\n## ", 1)[0]
    for name in ("loss.png", "--report_to tensorboard", "wandb", "Images", "--objective dpo", "simpo", "orpo",
                 "GRPO", "my_rewards.py", "--adapter qlora", "--optim adamw_8bit"):  # fmt: skip
        assert name in jobs, name
    shipped = {p.stem for p in bundled_configs().values()}
    named = set(re.findall(r"\(`([a-z0-9_.-]+)`[,)]", jobs)) | set(re.findall(r", `([a-z0-9_.-]+)`\)", jobs))
    assert shipped - {"arithmetic-lora"} <= named, shipped - named  # (text SFT is the quickstart's)
    monkeypatch.chdir(tmp_path)
    lines = [ln for b in blocks("Every job") for ln in b.replace("\\\n", " ").splitlines()]
    trains = [shlex.split(ln, comments=True) for ln in lines if "hybridtune train" in ln]
    assert len(trains) >= 3
    for argv in trains:
        argv = argv[argv.index("train") + 1 :]
        path = argv.pop(0) if not argv[0].startswith("--") else None
        load_config(path, parse_overrides(argv))  # a bad key or value raises


def test_the_readmes_reward_function_is_called_as_grpo_calls_it(tmp_path, monkeypatch):
    (code,) = [b for b in blocks("Every job") if b.startswith("# my_rewards.py")]
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)
    funcs = load_reward_funcs(["my_rewards.py:right_sum"], max_completion_length=8)
    rng = random.Random()
    answer = [str(rng.randrange(100)) for _ in range(rng.randrange(3, 9))]
    right = [rng.random() < 0.5 for _ in answer]
    texts = [(a if r else a + "1") + rng.choice(["", " ", "\n"]) for a, r in zip(answer, right)]
    n = len(answer)
    # plain prompts give text; chat prompts (the README's own command: the bundled chats) give TRL's message lists
    for prompts, completions in (
        (["x+y="] * n, texts),
        ([[{"role": "user", "content": "x+y="}]] * n, [[{"role": "assistant", "content": t}] for t in texts]),
    ):
        got = score(funcs, prompts, completions, [[1]] * n, {"answer": answer}, ["r"] * n)
        assert got[:, 0].tolist() == [float(r) for r in right]


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
    # This checkout's sources, whatever the working directory (a relative PYTHONPATH would name another install's).
    env["PYTHONPATH"] = os.pathsep.join([str(README.parent / "src"), *filter(None, [env.get("PYTHONPATH")])])
    times = []
    for argv in quickstart():
        argv = [a.replace(HUB_ID, "acme/tiny-qwen") for a in argv]
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
    kept = sorted(p.name for p in (work / "outputs" / "chat-lora").glob("checkpoint-*"))
    assert kept == ["checkpoint-200", "checkpoint-400"], kept  # save_total_limit 2 of the saves at 200 and 400
    assert (work / "outputs" / "step-200" / "final" / "adapter_config.json").is_file()
    assert (work / "outputs" / "chat-lora" / "loss.png").is_file()
    assert (work / "outputs" / "merged" / "config.json").is_file()
    print("readme walk:", ", ".join(f"{name} {s:.1f}s" for name, s in times), f"total {sum(s for _, s in times):.1f}s")
