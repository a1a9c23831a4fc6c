"""A QLoRA adapter at inference (`generate`, `chat`, `eval` open it through infer/load.py): with its run's
final/hybridtune.json, or only its model card's `qlora` tag, it goes on its base's NF4 round trip, as it trained,
and says so; without either (plain peft files) it goes on the full-precision weights, said in one warning line; a plain LoRA
adapter with its record says nothing of quantisation."""

from __future__ import annotations

import shutil

import pytest
import torch

from hybridtune.cli import main
from hybridtune.infer.load import open_model
from hybridtune.run.checkpoint import FINAL_META

pytest.importorskip("torchao")

WARNING = f"has no {FINAL_META} recording whether its base was quantised"


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _generate(capsys, model) -> tuple[str, str]:
    rc = main(["generate", str(model), "--prompt", "3+4=", "--max_new_tokens", "4", "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out, out.err


def test_a_qlora_adapter_goes_on_its_nf4_base_or_says_it_does_not(trained, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridtune.runtime import quant

    run = trained("tiny-qwen3_5", "qlora")
    final = run / "final"
    ids = torch.randint(0, 400, (1, 29), generator=torch.Generator().manual_seed(int(torch.randint(0, 10**6, ()))))
    # the base the adapter records (base_model/ beside final/) sent through NF4 and back, then the adapter: as trained
    base = AutoModelForCausalLM.from_pretrained(str(run / "base_model")).float().eval()
    quant.roundtrip_targets(base)
    want = _logits(PeftModel.from_pretrained(base, str(final)).eval(), ids)
    torch.testing.assert_close(_logits(open_model(str(final)).model, ids), want, rtol=1e-5, atol=1e-5)
    _, err = _generate(capsys, final)
    assert "trained on a 4-bit NF4 base (QLoRA): applied to its base's NF4 round trip" in err and WARNING not in err

    # copied without its record but with its card (as on the hub): the card's qlora tag records the NF4 base
    carded = tmp_path / "carded"
    shutil.copytree(final, carded)
    (carded / FINAL_META).unlink()
    shutil.copytree(run / "base_model", tmp_path / "base_model")  # (the base beside it, as beside final/)
    torch.testing.assert_close(_logits(open_model(str(carded)).model, ids), want, rtol=1e-5, atol=1e-5)
    _, err = _generate(capsys, carded)
    assert "applied to its base's NF4 round trip" in err and WARNING not in err

    # plain peft files, no record and no card: the full-precision weights, said in one line
    bare = tmp_path / "bare"
    shutil.copytree(carded, bare)
    (bare / "README.md").unlink()
    _, err = _generate(capsys, bare)
    lines = [x for x in err.splitlines() if WARNING in x]
    assert len(lines) == 1 and "full-precision weights" in lines[0] and "QLoRA" in lines[0]


def test_a_plain_lora_adapter_says_nothing_of_quantisation(trained, capsys):
    _, err = _generate(capsys, trained("tiny-qwen3_5", "lora") / "final")
    assert WARNING not in err and "NF4" not in err
