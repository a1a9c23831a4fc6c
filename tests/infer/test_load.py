"""What MODEL may name: an output directory stands for its final/ (else its newest checkpoint), an adapter finds its
base where the run left it even when the recorded path is gone, and a directory holding no model is one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ModelError
from hybridtune.infer.load import open_model


def test_an_unfinished_run_opens_at_its_newest_checkpoint(trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained("tiny-qwen3_5", "full"), run)
    shutil.rmtree(run / "final")
    opened = open_model(str(run))
    assert (opened.kind, opened.path, opened.step) == ("checkpoint", run / "checkpoint-4", 4)
    shutil.rmtree(run / "checkpoint-2")
    shutil.rmtree(run / "checkpoint-4")
    with pytest.raises(ModelError, match="holds no final/ and no checkpoint yet"):
        open_model(str(run))


def test_a_moved_adapter_finds_the_base_beside_it(trained, tmp_path):
    src = trained("tiny-qwen3_5", "lora")
    moved = tmp_path / "moved"
    for name in ("final", "base_model"):
        shutil.copytree(src / name, moved / name)
    config = moved / "final" / "adapter_config.json"
    data = json.loads(config.read_text())
    data["base_model_name_or_path"] = str(tmp_path / "gone" / "base_model")  # where it was before the move
    config.write_text(json.dumps(data))
    opened = open_model(str(moved / "final"))
    assert opened.kind == "adapter" and opened.base == str(moved / "base_model")
    want = open_model(str(src / "final"))
    mine, theirs = dict(opened.model.named_parameters()), dict(want.model.named_parameters())
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    shutil.rmtree(moved / "base_model")
    with pytest.raises(ModelError, match="is not a local directory and no base_model/ lies beside"):
        open_model(str(moved / "final"))


def test_a_directory_without_a_model_is_one_line(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ModelError, match="holds no model: expected config.json"):
        open_model(str(tmp_path))


def test_a_checkpoint_of_a_run_on_a_relative_base_opens_from_another_directory(tmp_path, chat_data, monkeypatch):
    """A run named its local base relative to where it ran (`--base_model ck/model`): opened from any other
    directory, its checkpoint's base was taken for the hub id 'ck/model' (offline: not cached; online: downloaded
    from whoever owns that name)."""
    from checkpoints import make_checkpoint
    from hybridtune.train.trainer import Trainer

    work = tmp_path / "work"
    make_checkpoint(work / "ck", "qwen3_5_text", name="model")
    monkeypatch.chdir(work)
    keys = dict(base_model="ck/model", dataset=str(Path(chat_data).resolve()), adapter="lora", sequence_len=64)
    t = Trainer(load_config(None, keys | dict(max_steps=2, save_steps=2, eval_steps=0, output_dir="out"), warn=False))
    t.setup()
    t.train()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    opened = open_model(str(work / "out" / "checkpoint-2"))
    assert opened.kind == "checkpoint" and opened.loaded.source_dir == work / "ck" / "model"
