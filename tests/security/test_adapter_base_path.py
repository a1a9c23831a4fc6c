"""REDTEAM reproduction 6 through the CLI: a LoRA run archived with `cp -r`, then trained again in its own directory
(`--seed 7 --overwrite`: other random base weights), is evaluated, generated from and merged on the archive's own
`base_model/`, never on the new run's. Before the fix the adapter recorded OUTPUT_DIR/base_model absolutely and the
archive silently used the new base (another eval_loss, exit 0)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest
import torch

from hybridtune.cli import main

TRAIN = ["train", "--adapter", "lora", "--max_steps", "2", "--sequence_len", "64", "--eval_steps", "0"]


def _eval_loss(model, data) -> float:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["eval", "--model", str(model), "--dataset", data, "--json"]) == 0
    text = out.getvalue()
    return json.loads(text[text.index("{") :])["eval_loss"]


@pytest.fixture(scope="module")
def archived(tmp_path_factory, small_data):
    """(archive, rerun, its eval_loss): runs/a trained and evaluated, copied to archive, then trained again in runs/a
    with another seed."""
    root = tmp_path_factory.mktemp("archived")
    run = root / "runs" / "a"
    assert main([*TRAIN, "--dataset", small_data, "--output_dir", str(run)]) == 0
    before = _eval_loss(run, small_data)
    archive = root / "archive"
    shutil.copytree(run, archive)
    assert main([*TRAIN, "--dataset", small_data, "--output_dir", str(run), "--seed", "7", "--overwrite"]) == 0
    return archive, run, before


def test_an_archived_run_is_evaluated_on_its_own_base(archived, small_data):
    archive, rerun, before = archived
    assert _eval_loss(archive, small_data) == pytest.approx(before, abs=1e-6)  # as evaluated before the copy
    assert _eval_loss(rerun, small_data) != pytest.approx(before, abs=1e-3)  # the two runs do differ


def test_an_archived_run_is_merged_on_its_own_base(archived, tmp_path):
    from transformers import AutoModelForCausalLM

    archive, rerun, before = archived
    assert main(["merge", str(archive), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    own = AutoModelForCausalLM.from_pretrained(str(archive / "base_model"))
    other = AutoModelForCausalLM.from_pretrained(str(rerun / "base_model"))
    # embed_tokens carries no LoRA: the merged model's is its base's, bit for bit.
    assert torch.equal(merged.model.embed_tokens.weight, own.model.embed_tokens.weight)
    assert not torch.equal(merged.model.embed_tokens.weight, other.model.embed_tokens.weight)
    assert json.loads((tmp_path / "merged" / "hybridtune.json").read_text())["base"].endswith("archive/base_model")


def test_an_old_absolute_record_of_another_runs_base_is_overruled_and_said(archived, small_data, tmp_path, capsys):
    """An adapter exported before the fix records the absolute OUTPUT_DIR/base_model of the original run: the
    archive still uses its own base, and the log says in one line that the record named another directory."""
    archive, rerun, before = archived
    old = tmp_path / "old"
    shutil.copytree(archive, old)
    config = old / "final" / "adapter_config.json"
    data = json.loads(config.read_text())
    data["base_model_name_or_path"] = str((rerun / "base_model").resolve())
    config.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["eval", "--model", str(old), "--dataset", small_data, "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out[captured.out.index("{") :])["eval_loss"] == pytest.approx(before, abs=1e-6)
    said = [line for line in captured.err.splitlines() if "records base" in line]
    assert len(said) == 1 and str((rerun / "base_model").resolve()) in said[0], captured.err
