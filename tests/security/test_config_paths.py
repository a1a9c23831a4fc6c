"""Every path of a training config is made absolute once, at load (REDTEAM2 defect 2, its config half): a process
that changes its working directory later (a reward function's os.chdir) no longer moves the run's output_dir, data,
model, template, checkpoint or reward file. Names that are not local paths (a hub id, a preset, a tokenizer's named
template, `latest`, `hybridtune:` names) stay as written; a recorded run's config (not training) keeps its own."""

from __future__ import annotations

import os
import random

from hybridtune.config import load_config


def _tree(root):
    """Relative files and directories of a run's inputs under `root`, with fresh names."""
    tag = random.randint(0, 10**6)
    (root / f"data{tag}").mkdir()
    files = {
        "data": f"data{tag}/chats.jsonl",
        "more": f"data{tag}/more.jsonl",
        "template": f"tpl{tag}.jinja",
        "reward": f"reward{tag}.py",
    }
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
    cfg = load_config(
        None,
        {
            "base_model": f["model"],
            "tokenizer": f["tok"],
            "chat_template": f["template"],
            "datasets": [{"path": f["data"]}, {"path": f["data"].rsplit("/", 1)[0] + "/*.jsonl"}],
            "test_datasets": [{"path": f["more"]}],
            "output_dir": "runs/x",  # (does not exist yet: absolute all the same)
            "resume_from_checkpoint": f["ckpt"],
            "objective": "grpo",
            "reward_funcs": [f"{f['reward']}:score", "format"],
            "adapter": "lora",
        },
        warn=False,
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.chdir(elsewhere)  # (what a reward function did)
    assert cfg.output_dir == str(here / "runs" / "x")
    assert cfg.base_model == str(here / f["model"]) and cfg.tokenizer == str(here / f["tok"])
    assert cfg.chat_template == str(here / f["template"])
    assert [d.path for d in cfg.datasets] == [
        str(here / f["data"]),
        str(here / f["data"].rsplit("/", 1)[0]) + "/*.jsonl",
    ]
    assert cfg.test_datasets[0].path == str(here / f["more"])
    assert cfg.resume_from_checkpoint == str(here / f["ckpt"])
    assert cfg.reward_funcs == [f"{here / f['reward']}:score", "format"]
    for p in (cfg.base_model, cfg.tokenizer, cfg.chat_template, cfg.datasets[0].path, cfg.resume_from_checkpoint):
        assert os.path.exists(p)


def test_the_dataset_shorthand_and_names_that_are_not_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    f = _tree(tmp_path)
    cfg = load_config(None, {"dataset": [f["data"], "org/not-here"], "output_dir": "out"}, warn=False)
    assert cfg.dataset == [str(tmp_path / f["data"]), "org/not-here"]  # a dataset id stays an id
    kept = load_config(
        None,
        {
            "base_model": "tiny-qwen3_5",
            "dataset": "hybridtune:sample/arithmetic.jsonl",
            "chat_template": "tool_use",
            "resume_from_checkpoint": "latest",
            "output_dir": str(tmp_path / "o"),
        },  # fmt: skip
        warn=False,
    )
    assert (kept.base_model, kept.dataset, kept.chat_template) == (
        "tiny-qwen3_5",
        "hybridtune:sample/arithmetic.jsonl",
        "tool_use",
    )
    assert kept.resume_from_checkpoint == "latest" and kept.output_dir == str(tmp_path / "o")
    hub = load_config(None, {"base_model": "Qwen/Qwen3.5-0.8B", "output_dir": "o"}, warn=False)
    assert hub.base_model == "Qwen/Qwen3.5-0.8B"


def test_a_recorded_runs_config_keeps_its_paths(tmp_path, monkeypatch):
    """A config not about to train (a run's record, read back by eval or export) is relative to its run's own
    directory, which infer/load.py resolves: load leaves it as written."""
    monkeypatch.chdir(tmp_path)
    f = _tree(tmp_path)
    cfg = load_config(None, {"dataset": f["data"], "output_dir": "out"}, warn=False, training=False)
    assert (cfg.dataset, cfg.output_dir) == (f["data"], "out")
