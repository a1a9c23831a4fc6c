"""QLoRA end to end on the CPU (slow tier): `adapter: qlora` trains a tiny preset (the loss falls), resumes from a
checkpoint as if never stopped, and its merge and export load in the original transformers class with the logits of
the adapted NF4 model (its base dequantised: base_model/ holds those values, and a checkpoint's base goes through
NF4 before the merge); the compiled loop over an NF4 base (Linear and expert weights) has no graph break."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from checkpoints import make_checkpoint
from hybridtune.ops import nf4
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.merge import merge
from hybridtune.runtime import quant
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg

pytestmark = pytest.mark.slow
pytest.importorskip("torchao")


def _train(cfg, stop_after=None):
    t = Trainer(cfg)
    t.setup()
    if stop_after is not None:

        def interrupt(rec):
            if rec["step"] == stop_after:
                raise KeyboardInterrupt

        t.on_log = interrupt
    return t, t.train()


def _logits(model, ids):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits.float()


def test_qlora_trains_resumes_merges_and_exports(tmp_path, small_data):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridtune.infer.export_command import export_checkpoint

    kw = dict(adapter="qlora", max_steps=6, save_steps=3, lora_dropout=0.0, learning_rate=0.02, warmup_steps=0)
    t, full = _train(make_cfg(tmp_path / "a", small_data, **kw))
    assert t.cfg.load_in_4bit and any(nf4.is_nf4(p) for p in t.model.parameters())
    assert sum(full.losses[-2:]) / 2 < full.losses[0] - 0.1, full.losses  # it learns
    # resume: stopped after step 3 (checkpoint-3), resumed, the same losses
    _, part = _train(make_cfg(tmp_path / "b", small_data, **kw), stop_after=3)
    _, rest = _train(make_cfg(tmp_path / "b", small_data, **kw, resume_from_checkpoint="latest"))
    assert part.steps == 3 and len(rest.losses) == 3
    assert max(abs(a - b) for a, b in zip(full.losses, part.losses + rest.losses)) < 1e-5

    final = tmp_path / "a" / "final"
    assert json.loads((final / ckpt.FINAL_META).read_text())["base_quantization"] == "nf4"
    base_dir = tmp_path / "a" / "base_model"
    base = AutoModelForCausalLM.from_pretrained(str(base_dir))
    live = dict(t.model.named_parameters())
    name = next(n for n in live if n.endswith("linear_attn.in_proj_z.base_layer.weight"))
    saved = dict(base.named_parameters())[name.removeprefix("base_model.model.").replace(".base_layer", "")]
    assert torch.equal(saved, nf4.dequantize(live[name], saved.dtype))  # base_model/ holds the NF4 values
    n = len(quant.targets(base))  # which merge reads from the weights alone (no file says so) and keeps as they are
    assert quant.roundtrip_targets(base) == (0, n) and n > 0
    ids = torch.randint(0, base.config.vocab_size, (1, 41), generator=torch.Generator().manual_seed(0))
    adapted = _logits(t.model, ids)  # the live QLoRA model: NF4 base + LoRA
    assert (adapted - _logits(base, ids)).abs().max() > 1e-3  # the adapter does something
    merged = AutoModelForCausalLM.from_pretrained(str(merge(final, tmp_path / "merged")))
    assert type(merged) is type(base) and not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(_logits(merged, ids), adapted, rtol=1e-4, atol=1e-4)

    # `hybridtune export checkpoint-3 OUT --merged`: the checkpoint rebuilt on its NF4 base, written as the run's own
    out = tmp_path / "exported"
    export_checkpoint(tmp_path / "a" / "checkpoint-3", out, merged=True)
    exported_base = AutoModelForCausalLM.from_pretrained(str(out / "base_model"))
    for (n, p), (_, q) in zip(exported_base.named_parameters(), base.named_parameters()):
        assert torch.equal(p, q), n  # the same NF4 base, dequantised
    at3 = PeftModel.from_pretrained(exported_base, str(out / "final"))
    merged3 = AutoModelForCausalLM.from_pretrained(str(out / "merged"))
    torch.testing.assert_close(_logits(merged3, ids), _logits(at3, ids), rtol=1e-4, atol=1e-4)


def test_qlora_merge_onto_a_checkpoint_uses_the_nf4_base(tmp_path, small_data):
    """A real checkpoint (Qwen3-Next: MoE experts, in_proj_qkvz) as the base: merge folds the adapter into the NF4
    values the adapter trained on, not into the checkpoint's own weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hybridtune.infer.load import open_model

    src = make_checkpoint(tmp_path, "qwen3_next")
    cfg = make_cfg(tmp_path / "run", small_data, base_model=str(src), adapter="qlora", max_steps=2, lora_dropout=0.0)
    cfg.learning_rate, cfg.lora_target_parameters = 0.05, ["gate_up_proj", "down_proj"]
    t, res = _train(cfg)
    names = {n.rsplit(".", 1)[-1] for n, p in t.model.named_parameters() if nf4.is_nf4(p)}
    assert {"gate_up_proj", "down_proj", "weight"} <= names
    ids = torch.randint(0, 400, (1, 33), generator=torch.Generator().manual_seed(1))
    adapted = _logits(t.model, ids)
    merged = AutoModelForCausalLM.from_pretrained(str(merge(res.final_dir, tmp_path / "merged")))
    torch.testing.assert_close(_logits(merged, ids), adapted, rtol=1e-4, atol=1e-4)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(src)), str(res.final_dir))
    assert (_logits(plain, ids) - adapted).abs().max() > 1e-3  # the unquantised base would not be it
    opened = open_model(str(res.final_dir))  # what generate, chat and eval use: the NF4 values too
    torch.testing.assert_close(_logits(opened.model, ids), adapted, rtol=1e-4, atol=1e-4)


def test_compiled_loop_over_an_nf4_base_has_no_graph_break():
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compiler"))
    from loop_models import assert_close_step, packed_batch, train_step
    from qlora_models import qlora_model

    torch._dynamo.reset()
    model, _ = qlora_model("tiny-qwen3_5_moe", experts=True, layers=["linear_attention", "full_attention"])
    model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    batches = [packed_batch(lens, "cpu", i) for i, lens in enumerate([[10, 30, 35], [64, 11]])]
    eager = [train_step(model, b) for b in batches]
    handle = compile_loop(model, backend="eager")
    counters.clear()
    for b, want in zip(batches, eager):
        assert_close_step(train_step(model, b), want, "cpu")
    assert dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] == 1 and handle.calls == 2 and handle.eager_calls == 0


def test_trainer_compiled_loop_with_the_fused_loss_over_an_nf4_base(tmp_path, small_data, aot_eager):
    """The trainer's own compiled loop (aot_eager: AOT autograd traces the backward too) with the fused loss over a
    QLoRA base: no graph break, and the losses of the same run uncompiled."""
    from torch._dynamo.utils import counters

    from train_runs import run_static

    _, plain = run_static(tmp_path / "off", small_data, max_steps=2, compile="off", adapter="qlora")
    counters.clear()
    t, looped = run_static(tmp_path / "loop", small_data, max_steps=2, compile="loop", adapter="qlora")
    assert t.choices.fused_loss.value is True and aot_eager and any(nf4.is_nf4(p) for p in t.model.parameters())
    assert t.choices.compile_regions.value is False  # torch's regions take no NF4 weight: every layer inlined
    assert dict(counters["graph_break"]) == {}
    assert looped.losses == pytest.approx(plain.losses, rel=1e-5, abs=0)
