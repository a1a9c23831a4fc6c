"""`hybridtune export OUTPUT_DIR/checkpoint-N OUT`: the checkpoint's exact weights in a folder that transformers
(full fine-tune) and peft (LoRA) load; the result is a finished output directory of that run at step N."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from peft import PeftModel
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from hybridtune import cli
from hybridtune.errors import ModelError, OutputDirError
from hybridtune.infer.export_command import export_checkpoint
from hybridtune.infer.load import open_model

FAMILIES = [
    ("tiny-qwen3_5", "full"),
    ("tiny-qwen3_5", "lora"),
    pytest.param("tiny-qwen3_next", "full", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3_next", "lora", marks=pytest.mark.slow),
]


def checkpoint_model_tensors(checkpoint: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """The model tensors a DCP checkpoint holds, read by torch's own converter (test-only: it unpickles), named as
    in the model (the trainer's LossModule prefix `model.` and DCP's `model.` key removed)."""
    dcp_to_torch_save(checkpoint / "state", tmp / "state.pt")
    state = torch.load(tmp / "state.pt", weights_only=False)["model"]
    return {k.removeprefix("model."): v for k, v in state.items()}


@pytest.mark.parametrize("preset, adapter", FAMILIES)
def test_export_of_a_checkpoint_holds_its_exact_weights(trained, tmp_path, preset, adapter):
    out = trained(preset, adapter)
    want = checkpoint_model_tensors(out / "checkpoint-2", tmp_path)
    final = export_checkpoint(out / "checkpoint-2", tmp_path / "best")
    assert final == tmp_path / "best" / "final"
    assert json.loads((final / "hybridtune.json").read_text())["steps"] == 2
    if adapter == "full":
        model = AutoModelForCausalLM.from_pretrained(final)
        got = model.state_dict()
        assert set(want) <= set(got)
        for name, tensor in want.items():
            assert torch.equal(got[name].to(tensor.dtype), tensor), name
        assert all(p.dtype == torch.float32 for p in model.parameters())  # a preset's source dtype
    else:
        saved = safetensors.torch.load_file(final / "adapter_model.safetensors")
        lora = {k: v for k, v in want.items() if "lora_" in k}
        assert len(saved) == len(lora) > 0
        base_dir = final / json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
        assert base_dir.resolve() == (tmp_path / "best" / "base_model").resolve()  # recorded relative to final/
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), final)
        got = dict(model.named_parameters(remove_duplicate=False))
        # Every tensor of the checkpoint, the adapter's and (torch's DCP keeps a tied frozen lm_head among the
        # trainable-only state) the frozen base's, is the loaded model's.
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), name
        # The base beside it is the run's own base (a preset's seeded init), bit for bit.
        run_base = safetensors.torch.load_file(out / "base_model" / "model.safetensors")
        new_base = safetensors.torch.load_file(tmp_path / "best" / "base_model" / "model.safetensors")
        assert run_base.keys() == new_base.keys() and all(torch.equal(run_base[k], new_base[k]) for k in run_base)
    # OUT is a finished run directory at that step: the loader opens its final/ and knows the run.
    opened = open_model(str(tmp_path / "best"))
    assert opened.path == final and opened.step == 2 and opened.run is not None


def test_export_refuses_what_it_cannot_or_must_not_do(trained, tmp_path, capsys):
    out = trained("tiny-qwen3_5", "full")
    with pytest.raises(ModelError, match="a run's final model, already loadable"):
        export_checkpoint(out / "final", tmp_path / "x")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not empty"):
        export_checkpoint(out / "checkpoint-2", taken)
    assert (taken / "keep.txt").read_text() == "mine"
    assert cli.main(["export", str(out / "checkpoint-9"), str(tmp_path / "y")]) == 2
    assert "give one of them" in capsys.readouterr().err
    assert cli.main(["export", str(out), str(tmp_path / "y")]) == 2
    assert "give a checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["export", "generate", "eval"])
def test_a_checkpoint_save_total_limit_removed_is_one_line_naming_those_kept(trained, tmp_path, capsys, command):
    """The README's `export OUTPUT_DIR/checkpoint-200` after save_total_limit rotated it out: one line, exit 2,
    naming the checkpoints the run kept (and its final/), not a hub lookup of a name or a bare 'not a checkpoint'."""
    out = trained("tiny-qwen3_5", "lora")
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == ["checkpoint-2", "checkpoint-4"]
    gone = out / "checkpoint-1"  # saved at step 1 of a run that kept the newest two, say
    argv = {"export": [str(gone), str(tmp_path / "y")], "generate": [str(gone), "--prompt", "1+1="],
            "eval": ["--model", str(gone), "--split", "heldout"]}[command]  # fmt: skip
    assert cli.main([command, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"'{gone}' does not exist" in err, err
    assert err.endswith("holds checkpoint-2, checkpoint-4, final/: give one of them"), err
    assert not (tmp_path / "y").exists()


def test_a_damaged_checkpoint_is_refused_by_its_checksums(trained, tmp_path):
    import shutil

    from hybridtune.run.checkpoint import CheckpointError

    src = trained("tiny-qwen3_5", "lora")
    copy = tmp_path / "run"
    shutil.copytree(src, copy)
    shard = next((copy / "checkpoint-2" / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="cannot be loaded: .*distcp"):
        open_model(str(copy / "checkpoint-2"))


def test_export_overwrite_never_replaces_a_users_final_nor_writes_into_the_checkpoint(trained, tmp_path):
    """--overwrite replaced OUT/final whole, a user's own final/ included; OUT = the checkpoint itself wrote final/
    and a run file into it, which a resume then skipped as damaged (extra files)."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(trained("tiny-qwen3_5", "full"), out)
    mine = tmp_path / "mine"
    (mine / "final").mkdir(parents=True)
    (mine / "final" / "notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not written by hybridtune"):
        export_checkpoint(out / "checkpoint-2", mine, overwrite=True)
    assert (mine / "final" / "notes.txt").read_text() == "mine"
    listed = sorted(p.name for p in (out / "checkpoint-2").iterdir())
    for target in (out / "checkpoint-2", out / "checkpoint-2" / "x"):
        with pytest.raises(OutputDirError, match="inside the checkpoint"):
            export_checkpoint(out / "checkpoint-2", target, overwrite=True)
    assert sorted(p.name for p in (out / "checkpoint-2").iterdir()) == listed
