"""The final adapter loads with peft; `hybridtune merge` writes a model transformers loads with equal logits.
A Qwen3.5 ForConditionalGeneration checkpoint fine-tunes text-only."""

from __future__ import annotations

import torch

from hybridtune.config import load_config
from hybridtune.train.trainer import Trainer
from hybridtune.train.merge import merge


def test_adapter_loads_and_merge_round_trip(tmp_path, small_data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = load_config(
        None,
        dict(
            dataset=small_data,
            adapter="lora",
            sequence_len=64,
            max_steps=3,
            eval_steps=0,
            output_dir=str(tmp_path / "run"),
            learning_rate=0.05,
        ),  # a large step so the adapter visibly changes the logits
    )
    t = Trainer(cfg)
    t.setup()
    res = t.train()
    base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "base_model"))
    ids = torch.randint(0, base.config.vocab_size, (1, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base(input_ids=ids).logits
    peft_model = PeftModel.from_pretrained(base, res.final_dir).eval()
    with torch.no_grad():
        adapted = peft_model(input_ids=ids).logits
    assert (adapted - base_logits).abs().max() > 1e-3  # the adapter does something

    out = merge(res.final_dir, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, adapted, rtol=1e-4, atol=1e-4)


def test_conditional_generation_checkpoint_trains_text_only(tmp_path, small_data):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from hybridtune.models.presets import preset_config
    from hybridtune.models.tokenizer_files import bundled_tokenizer

    tok = bundled_tokenizer()
    text = preset_config("tiny-qwen3_5", vocab_size=len(tok))
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=64, out_hidden_size=text.hidden_size)
    ckpt_dir = tmp_path / "vl"
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text.to_dict(), vision_config=vision)).save_pretrained(
        ckpt_dir
    )
    tok.save_pretrained(ckpt_dir)
    cfg = load_config(
        None,
        dict(
            base_model=str(ckpt_dir),
            dataset=small_data,
            adapter="lora",
            sequence_len=64,
            max_steps=2,
            eval_steps=0,
            output_dir=str(tmp_path / "run"),
        ),
    )
    t = Trainer(cfg)
    t.setup()
    assert not any("visual" in n for n, _ in t.model.named_parameters())
    res = t.train()
    assert res.steps == 2 and all(torch.isfinite(torch.tensor(res.losses)))
