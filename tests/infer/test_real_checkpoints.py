"""The use-the-model commands on a run from a checkpoint of a released kind: Qwen3.5 vision-language saved in bf16
with `mtp.*` tensors, named by hub id (an offline hub cache). generate equals stock transformers + peft on the
original class, eval equals the logged eval, for final/ and a checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers
from infer_runs import PROMPTS, logged_evals, run_config
from peft import PeftModel

from hybridtune.infer.evaluate import eval_config, run_eval
from hybridtune.infer.load import open_model
from hybridtune.runtime.generation import Sampling, complete, render
from hybridtune.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import ARCHITECTURES, hub_cache, make_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow  # two training runs on a vision-language checkpoint


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_a_hub_checkpoint_run_generates_and_evaluates_as_stock(tmp_path, monkeypatch, chat_data, adapter):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl", torch.bfloat16)
    home = hub_cache(tmp_path, "org/tiny-vl", ckpt)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    trainer = Trainer(run_config(out, chat_data, "org/tiny-vl", adapter))
    trainer.setup()
    trainer.train()
    final = out / "final"
    cls = getattr(transformers, ARCHITECTURES["qwen3_5_vl"])
    if adapter == "lora":
        assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/tiny-vl"
        # (huggingface_hub read HF_HOME when it was imported: the stock call names the cache itself)
        base = cls.from_pretrained("org/tiny-vl", cache_dir=home / "hub", local_files_only=True)
        stock = PeftModel.from_pretrained(base, final).eval()
    else:
        stock = cls.from_pretrained(final).eval()
    tok = transformers.AutoTokenizer.from_pretrained(final)
    sampling = Sampling(max_new_tokens=8, temperature=1.0, seed=11)
    texts = [render(tok, p, True) for p in PROMPTS]
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(11)
    with torch.inference_mode():
        ref = stock.generate(**enc, max_new_tokens=8, do_sample=True, temperature=1.0, top_p=1.0, top_k=None)
    ref = ref[:, enc["input_ids"].shape[1] :].tolist()
    eos = tok.eos_token_id
    ref = [row[: row.index(eos) + 1] if eos in row else row for row in ref]
    opened = open_model(str(final))
    assert type(opened.model.get_base_model() if adapter == "lora" else opened.model) is cls
    got = [ids for ids, _ in complete(opened.model, opened.tokenizer, texts, sampling, True, len(texts))]
    assert got == ref
    logged = logged_evals(out)
    # The checkpoint holds the fp32 weights the trainer evaluated, an adapter's final/ too (its base is the bf16
    # checkpoint, upcast exactly as the trainer did); a full fine-tune's final/ is saved in the source's bf16.
    for where, step, tol in (("final", 4, 1e-6 if adapter == "lora" else 1e-2), ("checkpoint-2", 2, 1e-6)):
        o = open_model(str(out / where), patched=True)
        res = run_eval(o, eval_config(o.run, {}), "heldout", "cpu")
        assert res["eval_loss"] == pytest.approx(logged[step]["eval_loss"], rel=tol), where
