"""An adapter's base travels with it (run/adapter_base.py): a preset run's adapter records its `base_model/` relative
to itself, a copied output directory opens and merges on its own base, a record naming another directory than the
`base_model/` shipped beside the adapter is overruled with one warning line, and stock peft still loads the adapter
(`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)`, and AutoPeftModel from inside
the adapter directory, where peft reads a relative record)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ModelError
from hybridtune.infer.load import open_model
from hybridtune.models.loading import LoadedModel
from hybridtune.run.merge import merge
from hybridtune.train.trainer import Trainer


def _train(out: Path, data: str, seed: int = 0, overwrite: bool = False) -> Path:
    cfg = load_config(
        None,
        dict(
            base_model="tiny-qwen3_5",
            dataset=data,
            adapter="lora",
            sequence_len=64,
            max_steps=2,
            eval_steps=0,
            val_set_size=4,
            learning_rate=0.02,
            lora_r=4,
            lora_alpha=8,
            seed=seed,
            overwrite=overwrite,
            warmup_steps=0,
            output_dir=str(out),
            device="cpu",
        ),  # fmt: skip
    )
    t = Trainer(cfg)
    t.setup()
    t.train()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_data) -> Path:
    return _train(tmp_path_factory.mktemp("adapter-base") / "run", small_data)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, 23), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _logits(model, ids) -> torch.Tensor:
    return model.eval()(input_ids=ids).logits


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _record(adapter: Path, value) -> None:
    config = adapter / "adapter_config.json"
    data = json.loads(config.read_text())
    data["base_model_name_or_path"] = value
    config.write_text(json.dumps(data))


def test_a_preset_adapter_records_its_base_relative_to_itself_and_stock_peft_loads_it(run, monkeypatch):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    final = run / "final"
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "../base_model"
    base = AutoModelForCausalLM.from_pretrained(str(run / "base_model"))
    x = _ids(base.config.vocab_size)
    plain = _logits(base, x)
    stock = _logits(PeftModel.from_pretrained(base, str(final)), x)
    assert (stock - plain).abs().max() > 1e-4  # the adapter applies
    ours = open_model(str(final))
    assert Path(ours.base) == run / "base_model"
    torch.testing.assert_close(_logits(ours.model, x), stock, rtol=1e-4, atol=1e-4)
    monkeypatch.chdir(final)  # peft reads a relative record against the working directory
    auto = AutoPeftModelForCausalLM.from_pretrained(".")
    torch.testing.assert_close(_logits(auto, x), stock, rtol=1e-4, atol=1e-4)


def test_a_copied_run_opens_and_merges_on_its_own_base_after_the_original_is_trained_again(
    run, tmp_path, small_data, caplog
):
    """REDTEAM reproduction 6: archive a run, train again in its directory (another seed: other random base
    weights); the archive must still use its own base_model/ (before: the recorded absolute path, the new base)."""
    from transformers import AutoModelForCausalLM

    original = tmp_path / "runs" / "a"
    shutil.copytree(run, original)
    archive = tmp_path / "archive"
    shutil.copytree(original, archive)
    want = open_model(str(archive))
    _train(original, small_data, seed=7, overwrite=True)  # a new preset draw in the same place
    fresh = AutoModelForCausalLM.from_pretrained(str(original / "base_model"))
    kept = AutoModelForCausalLM.from_pretrained(str(archive / "base_model"))
    assert not torch.equal(fresh.model.embed_tokens.weight, kept.model.embed_tokens.weight)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        got = open_model(str(archive))
    assert Path(got.base).resolve() == (archive / "base_model").resolve()
    assert not [r for r in caplog.records if "records base" in r.getMessage()]  # its record names its own base
    mine, theirs = _params(got.model), _params(want.model)
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    merged = AutoModelForCausalLM.from_pretrained(str(merge(archive / "final", tmp_path / "merged")))
    x = _ids(kept.config.vocab_size)
    torch.testing.assert_close(_logits(merged, x), _logits(want.model, x), rtol=1e-4, atol=1e-4)


def test_a_record_naming_another_base_is_overruled_by_the_one_shipped_beside_it_with_one_warning(
    run, tmp_path, small_data, caplog
):
    """An adapter written before this fix records OUTPUT_DIR/base_model absolutely: once that directory holds
    another run's base, the base_model/ beside the adapter is used, and one line says so, for open and merge."""
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    other = _train(tmp_path / "other", small_data, seed=7)
    _record(copy / "final", str((other / "base_model").resolve()))
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        got = open_model(str(copy / "final"))
        merge(copy / "final", tmp_path / "merged")
    assert Path(got.base) == copy / "base_model"
    said = [r.getMessage() for r in caplog.records if "records base" in r.getMessage()]
    assert len(said) == 2 and all("\n" not in s for s in said), said  # one line each: open, merge
    assert str((other / "base_model").resolve()) in said[0] and str(copy / "base_model") in said[0]
    want = open_model(str(run / "final"))
    mine, theirs = _params(got.model), _params(want.model)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_relative_record_is_read_against_the_adapter_not_the_working_directory(run, tmp_path, monkeypatch):
    adapter = tmp_path / "adapters" / "a"
    shutil.copytree(run / "final", adapter)
    shutil.copytree(run / "base_model", tmp_path / "bases" / "b")
    _record(adapter, "../../bases/b")
    monkeypatch.chdir(run)  # here ../../bases/b names nothing
    assert Path(open_model(str(adapter)).base).resolve() == (tmp_path / "bases" / "b").resolve()
    _record(adapter, "../../bases/gone")
    with pytest.raises(ModelError, match="is not a local directory and no base_model/ lies beside"):
        open_model(str(adapter))


def test_what_an_export_records():
    from hybridtune.run import adapter_base

    hub = LoadedModel(None, None, "checkpoint", "org/model", Path("/cache/snap"), revision="abc123")
    assert adapter_base.record(hub, None, Path("/x/final")) == ("org/model", "abc123")
    local = LoadedModel(None, None, "checkpoint", "ck/model", Path("ck/model"))
    assert adapter_base.record(local, None, Path("/x/final")) == (str(Path("ck/model").absolute()), None)
    assert adapter_base.record(local, Path("/x/base_model"), Path("/x/final")) == ("../base_model", None)
    assert adapter_base.record(local, Path("/x/final/base_model"), Path("/x/final")) == ("base_model", None)
