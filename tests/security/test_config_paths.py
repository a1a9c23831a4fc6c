"""The paths a run reads or writes after it starts are made absolute once, at load (REDTEAM2 defect 2, its config
half): a process that changes its working directory later (a reward function's os.chdir) no longer moves the run's
output_dir (checkpoints, final/), its base model, tokenizer, template or the checkpoint it resumes. Names that are
not local paths (a hub id, a preset, a tokenizer's named template, `latest`) stay as written; so do the data and
reward files, read and hashed once before the first step and named in messages as the user wrote them; a recorded
run's config (not training) keeps its own paths."""

from __future__ import annotations

import os
import random

from hybridtune.config import load_config


def _tree(root):
    """Relative files and directories of a run's inputs under `root`, with fresh names."""
    tag = random.randint(0, 10**6)
    files = {"data": f"chats{tag}.jsonl", "template": f"tpl{tag}.jinja", "reward": f"reward{tag}.py"}
    for rel in files.values():
        (root / rel).write_text("{}\n")
    for d in ("model", "tok", "ckpt"):
        files[d] = f"{d}{tag}"
        (root / files[d]).mkdir()
    return files


def test_paths_are_absolute_at_load_and_stay_after_a_chdir(tmp_path, monkeypatch):
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    f = _tree(here)
    keys = {
        "base_model": f["model"],
        "tokenizer": f["tok"],
        "chat_template": f["template"],
        "dataset": f["data"],
        "output_dir": f"runs{random.randint(0, 99)}/x",  # (does not exist yet: absolute all the same)
        "resume_from_checkpoint": f["ckpt"],
        "objective": "grpo",
        "reward_funcs": [f"{f['reward']}:score", "format"],
        "adapter": "lora",
    }
    cfg = load_config(None, keys, warn=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)  # (what a reward function did)
    assert cfg.output_dir == str(here / keys["output_dir"])
    assert cfg.base_model == str(here / f["model"]) and cfg.tokenizer == str(here / f["tok"])
    assert cfg.chat_template == str(here / f["template"]) and cfg.resume_from_checkpoint == str(here / f["ckpt"])
    for p in (cfg.base_model, cfg.tokenizer, cfg.chat_template, cfg.resume_from_checkpoint):
        assert os.path.exists(p)
    # read once before the first step, and named as written in every message about them
    assert cfg.dataset == f["data"] and cfg.reward_funcs == keys["reward_funcs"]


def test_names_that_are_not_local_paths_stay(tmp_path):
    kept = load_config(
        None,
        {
            "base_model": "tiny-qwen3_5",
            "chat_template": "tool_use",
            "resume_from_checkpoint": "latest",
            "output_dir": str(tmp_path / "o"),
        },  # fmt: skip
        warn=False,
    )
    assert (kept.base_model, kept.chat_template, kept.resume_from_checkpoint) == ("tiny-qwen3_5", "tool_use", "latest")
    assert kept.output_dir == str(tmp_path / "o")
    hub = load_config(None, {"base_model": "Qwen/Qwen3.5-0.8B", "output_dir": "o"}, warn=False)
    assert hub.base_model == "Qwen/Qwen3.5-0.8B" and os.path.isabs(hub.output_dir)


def test_a_recorded_runs_config_keeps_its_paths(tmp_path, monkeypatch):
    """A config not about to train (a run's record, read back by eval or export) is relative to its run's own
    directory, which infer/load.py resolves: load leaves it as written."""
    monkeypatch.chdir(tmp_path)
    f = _tree(tmp_path)
    cfg = load_config(None, {"base_model": f["model"], "output_dir": "out"}, warn=False, training=False)
    assert (cfg.base_model, cfg.output_dir) == (f["model"], "out")
