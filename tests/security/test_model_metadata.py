"""Hand-edited or foreign model metadata and weights are one line and exit 2, never a traceback: pickled `.bin`
weights that hold more than tensors (a model directory, an adapter), a checkpoint.json whose step is not a number,
a config.json whose `architectures` names another family, and a base whose weights are not finite (said to be the
base's, not the learning rate's)."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from hybridtune.cli import main
from hybridtune.run import checkpoint as ckpt

TRAIN = ["train", "--max_steps", "2", "--save_steps", "2", "--sequence_len", "128", "--eval_steps", "0"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished two-step run of the default preset with checkpoint-2 and final/."""
    out = tmp_path_factory.mktemp("model-metadata-run") / "run"
    assert main([*TRAIN, "--output_dir", str(out)]) == 0
    return out


def _foreign_pickle(path, tensors: dict) -> None:
    """`tensors` pickled with a non-tensor global beside them (what torch.load(weights_only=True) refuses)."""
    torch.save({**tensors, "extra": argparse.Namespace(note="not a tensor")}, path)


def _refuses_the_pickle(line: str, name: str) -> None:
    assert name in line and "safetensors" in line and "weights_only" in line, line
    assert "argparse.Namespace" in line, line
    assert "False" not in line and "Re-running" not in line, line  # never advises weights_only=False


def test_a_model_directorys_pickle_with_foreign_globals(model_dir, tmp_path, error_line):
    pickled = tmp_path / "pickled"
    shutil.copytree(model_dir, pickled)
    _foreign_pickle(pickled / "pytorch_model.bin", load_file(pickled / "model.safetensors"))
    (pickled / "model.safetensors").unlink()
    line = error_line(["generate", str(pickled), "--prompt", "hi", "--max_new_tokens", "2"])
    _refuses_the_pickle(line, "pytorch_model.bin")


def test_a_model_directorys_plain_pickle_still_loads(model_dir, tmp_path, capsys):
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    torch.save(load_file(plain / "model.safetensors"), plain / "pytorch_model.bin")
    (plain / "model.safetensors").unlink()
    assert main(["generate", str(plain), "--prompt", "hi", "--max_new_tokens", "2"]) == 0


def test_an_adapters_pickle_with_foreign_globals(model_dir, tmp_path, error_line):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": str(model_dir), "r": 2, "target_modules": ["q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    _foreign_pickle(adapter / "adapter_model.bin", {})
    line = error_line(["generate", str(adapter), "--prompt", "hi", "--max_new_tokens", "2"])
    _refuses_the_pickle(line, "adapter_model.bin")


@pytest.mark.parametrize("step", ["x", None, [2], -1])
@pytest.mark.parametrize("command", ["generate", "export"])
def test_a_checkpoint_step_that_is_not_a_number(step, command, run_dir, tmp_path, error_line):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    meta_file = run / "checkpoint-2" / ckpt.META_FILE
    meta = json.loads(meta_file.read_text())
    meta["step"] = step
    meta_file.write_text(json.dumps(meta))
    args = ["--prompt", "hi", "--max_new_tokens", "2"] if command == "generate" else [str(tmp_path / "exported")]
    line = error_line([command, str(run / "checkpoint-2"), *args])
    assert ckpt.META_FILE in line and "step" in line, line


def test_a_final_step_that_is_not_a_number(run_dir, tmp_path, error_line):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run, symlinks=True)
    info = run / "final" / ckpt.FINAL_META
    info.write_text(json.dumps({**json.loads(info.read_text()), "steps": "x"}))
    line = error_line(["generate", str(run), "--prompt", "hi", "--max_new_tokens", "2"])
    assert ckpt.FINAL_META in line and "steps" in line, line


def test_architectures_naming_another_family(model_dir, tmp_path, error_line):
    foreign = tmp_path / "foreign"
    shutil.copytree(model_dir, foreign)
    config = json.loads((foreign / "config.json").read_text())
    (foreign / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    line = error_line(["generate", str(foreign), "--prompt", "hi", "--max_new_tokens", "2"])
    assert "LlamaForCausalLM" in line and config["model_type"] in line and "architectures" in line, line


@pytest.mark.parametrize("held_out", [True, False], ids=["eval-at-step-0", "first-step"])
def test_a_base_with_weights_that_are_not_finite(held_out, model_dir, tmp_path, error_line):
    nan = tmp_path / "nan-base"
    shutil.copytree(model_dir, nan)
    tensors = load_file(nan / "model.safetensors")
    name = next(k for k in sorted(tensors) if k.endswith("mlp.down_proj.weight"))
    tensors[name][0, 0] = float("nan")
    save_file(tensors, nan / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    extra = [] if held_out else ["--val_set_size", "0"]  # without held-out examples the first step finds it
    line = error_line([*TRAIN, "--base_model", str(nan), "--output_dir", str(out), *extra])
    assert "not finite" in line and "before any update" in line and name in line, line
    assert "learning_rate" not in line and ("step 0: the eval loss" if held_out else "step 1: the loss") in line, line
