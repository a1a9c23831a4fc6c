"""eval_samples: greedy generations from held-out prompts on the trained (patched) model equal stock transformers'
(and peft's) greedy decoding of the same weights, token for token; the trainer logs and writes them at each eval."""

from __future__ import annotations

import copy
import json

import peft
import pytest
import torch

from hybridtune.config import load_config
from hybridtune.models.anatomy import unwrap
from hybridtune.models.patching import is_patched
from hybridtune.runtime.generation import greedy
from hybridtune.train.samples import generate_samples, sample_prompts
from hybridtune.train.trainer import Trainer


def settings(out, data, **kw) -> dict:
    return {
        "dataset": data,
        "sequence_len": 64,
        "val_set_size": 8,
        "max_steps": 2,
        "eval_steps": 0,
        "warmup_steps": 1,
        "device": "cpu",
        "output_dir": str(out),
        "eval_samples": 2,
        "eval_max_new_tokens": 12,
        **kw,
    }


def stock_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A model built by transformers alone (SDPA attention, its own cache and GDN path, no hybridtune patch) holding
    `model`'s weights; peft-wrapped the same way when `model` is."""
    base = unwrap(model)
    config = copy.deepcopy(base.config)
    config.use_cache = True  # (the patch turned it off for training)
    stock = type(base)._from_config(config, attn_implementation="sdpa")
    if isinstance(model, peft.PeftModel):
        stock = peft.get_peft_model(stock, copy.deepcopy(model.peft_config["default"]))
    missing, unexpected = stock.load_state_dict(model.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    held = dict(model.named_parameters())
    for name, p in stock.named_parameters():  # the same dtypes too (a LoRA base held in bf16 on a GPU)
        p.data = p.data.to(held[name].dtype)
    assert not is_patched(stock)
    return stock.eval()


@pytest.mark.parametrize(
    "adapter, where",
    [
        ("full", {}),
        ("lora", {}),
        # On a GPU: bf16 autocast, the compiled loop and hybridtune's attention, all escaped with a cache.
        pytest.param("full", {"device": "cuda", "compile": "loop"}, marks=pytest.mark.cuda),
        pytest.param("lora", {"device": "cuda", "compile": "loop"}, marks=pytest.mark.cuda),
    ],
)
def test_samples_equal_stock_greedy_decoding(tmp_path, small_data, adapter, where):
    t = Trainer(load_config(None, settings(tmp_path / "run", small_data, adapter=adapter, **where)))
    t.setup()
    assert is_patched(unwrap(t.model))
    # Seeded noise on every weight (the adapters too): a random model whose greedy output runs on for many
    # different tokens, not one that stops at once.
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in t.model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * 0.1)
    ex = t._eval_examples()
    got = generate_samples(t.model, ex, t.tokenizer, t.cfg, t.device, t.autocast, t.dist)
    stock = stock_copy(t.model).to(t.device)
    prompts = sample_prompts(ex, 2)
    assert len(got) == len(prompts) == 2
    eos = t.tokenizer.eos_token_id
    for (prompt, reference), sample in zip(prompts, got):
        stop = sorted({reference[-1], eos})
        with torch.no_grad(), t.autocast():  # (bf16 on a GPU, as the eval's generation)
            ids = torch.tensor([prompt], device=t.device)
            want = stock.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=stop,
                pad_token_id=t.tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()  # fmt: skip
        with t.autocast():
            assert greedy(t.model, prompt, 12, stop, t.tokenizer.pad_token_id, t.device) == want
        assert sample == {
            "prompt": t.tokenizer.decode(prompt),
            "generated": t.tokenizer.decode(want),
            "reference": t.tokenizer.decode(reference),
        }
    assert any(len(set(s["generated"])) > 3 for s in got), got  # outputs with substance to compare


def test_trainer_writes_samples_at_each_eval(tmp_path, small_data, caplog):
    out = tmp_path / "run"
    t = Trainer(load_config(None, settings(out, small_data, eval_steps=1)))
    t.setup()
    with caplog.at_level("INFO", logger="hybridtune"):
        t.train()
    evals = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["type"] == "eval"]
    assert [r["step"] for r in evals] == [0, 1, 2]
    prompts = [t.tokenizer.decode(p) for p, _ in sample_prompts(t._eval_examples(), 2)]
    for r in evals:
        assert [s["prompt"] for s in r["samples"]] == prompts  # the same prompts at every eval
    # The last eval's samples are those of the final weights.
    assert evals[-1]["samples"] == generate_samples(
        t.model, t._eval_examples(), t.tokenizer, t.cfg, t.device, t.autocast, t.dist
    )
    assert "eval  step 2  sample 2/2" in caplog.text


def test_plain_text_has_no_prompt(caplog):
    from hybridtune.data.packing import Example

    examples = [Example([1, 2, 3], [1, 1, 1]), Example([1, 2], [0, 0])]
    assert sample_prompts(examples, 3) == []
    cfg = load_config(None, {"eval_samples": 2})
    with caplog.at_level("WARNING", logger="hybridtune"):
        assert generate_samples(None, examples, None, cfg, torch.device("cpu"), None) is None
    assert "no held-out example has a prompt" in caplog.text
