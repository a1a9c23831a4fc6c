"""A QLoRA adapter merged without its `final/hybridtune.json` (a bare peft adapter, e.g. pushed to the hub and
downloaded again) was folded into the full-precision base: another model than the one trained, with no warning (red
team 2, defect 8). Its card now records it (the `qlora` tag, which travels with README.md), merge reads either record,
`--base_quantization nf4` serves an adapter that keeps neither, and an adapter that records nothing is warned about."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridtune.cli import main
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.card import QLORA_TAG
from hybridtune.run.merge import card_tags

TRAIN = ["train", "--sequence_len", "128", "--eval_steps", "0", "--val_set_size", "0", "--max_steps", "2"]
NO_RECORD = "records no base quantization"


@pytest.fixture(scope="module")
def qlora(tmp_path_factory, model_dir, small_data) -> tuple[Path, Path]:
    """(the final/ adapter of a two-step QLoRA run on a saved fp32 checkpoint, that adapter's NF4 merge)."""
    root = tmp_path_factory.mktemp("qlora-merge")
    argv = [*TRAIN, "--dataset", small_data, "--adapter", "qlora", "--base_model", str(model_dir), "--seed", "7"]
    assert main([*argv, "--output_dir", str(root / "run")]) == 0
    assert main(["merge", str(root / "run" / "final"), str(root / "merged")]) == 0
    return root / "run" / "final", root / "merged"


def weights(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def same(a: Path, b: Path) -> bool:
    wa, wb = weights(a), weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def bare(qlora, tmp_path, *drop: str) -> Path:
    """A copy of the QLoRA adapter without the files `drop`."""
    adapter = tmp_path / "adapter"
    shutil.copytree(qlora[0], adapter)
    for name in drop:
        (adapter / name).unlink()
    return adapter


def merged(adapter: Path, tmp_path: Path, capsys, *flags: str) -> tuple[Path, str]:
    """The merge of `adapter` and what it logged (the CLI's own handler: stderr)."""
    out = tmp_path / f"merged{len(list(tmp_path.glob('merged*')))}"
    capsys.readouterr()
    assert main(["merge", str(adapter), str(out), *flags]) == 0
    return out, capsys.readouterr().err


def test_the_card_records_qlora(qlora):
    assert QLORA_TAG in card_tags(qlora[0] / "README.md")


def test_without_hybridtune_json_the_card_still_merges_through_nf4(qlora, tmp_path, capsys):
    out, said = merged(bare(qlora, tmp_path, ckpt.FINAL_META), tmp_path, capsys)
    assert same(out, qlora[1]) and NO_RECORD not in said, said


def test_a_bare_peft_adapter_is_warned_about_and_merges_as_told(qlora, tmp_path, capsys):
    adapter = bare(qlora, tmp_path, ckpt.FINAL_META, "README.md")
    plain, said = merged(adapter, tmp_path, capsys)
    assert NO_RECORD in said and "--base_quantization nf4" in said, said
    assert not same(plain, qlora[1])  # the full-precision base: not the model trained
    told, said = merged(adapter, tmp_path, capsys, "--base_quantization", "nf4")
    assert same(told, qlora[1]) and NO_RECORD not in said, said


def test_a_flag_against_the_record_is_said(qlora, tmp_path, capsys):
    out, said = merged(qlora[0], tmp_path, capsys, "--base_quantization", "none")
    assert "--base_quantization none given, but the adapter" in said and "records nf4" in said, said
    assert not same(out, qlora[1])


@pytest.mark.parametrize("card", ["---\ntags: [a, [b\n---\n", "---\n" + "[" * 5000 + "\n---\n", "no front matter\n"])
def test_a_card_that_is_not_yaml_records_nothing(tmp_path, card):
    (tmp_path / "README.md").write_text(card)
    assert card_tags(tmp_path / "README.md") == []
