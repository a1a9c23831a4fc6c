"""Checkpoints through the whole Trainer on the CPU: a full fine-tune of a bf16 checkpoint keeps fp32 master weights
(parameters and every AdamW state tensor fp32, so updates far below bf16's resolution still land), and a Qwen3.5
vision-language checkpoint trains (LoRA and full, fused and transformers' own loss, evaluation) in its original
class, its vision tower frozen and untouched, also under FSDP2 with two ranks (slow tier)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from checkpoints import make_checkpoint, read_tensors
from hybridtune.config import load_config
from hybridtune.train.trainer import Trainer


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "sums.jsonl"
    rows = []
    for _ in range(48):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append(
            {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"{a + b}"}]}
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _train(out, data, ckpt, **kw) -> Trainer:
    cfg = dict(
        base_model=str(ckpt),
        dataset=data,
        output_dir=str(out),
        sequence_len=64,
        max_steps=3,
        eval_steps=0,
        logging_steps=1,
        val_set_size=4,
        warmup_steps=0,
        lr_scheduler="constant",
    )
    t = Trainer(load_config(None, cfg | kw))
    t.setup()
    t.result = t.train()
    return t


def test_a_full_fine_tune_of_a_bf16_checkpoint_keeps_fp32_masters(tmp_path, data):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text", torch.bfloat16)
    before = read_tensors(ckpt)
    # bf16 autocast computes, as on a GPU; 1e-5 per step is far below bf16's resolution at these weights (|w| ~ 0.02:
    # a bf16 step there is 1.2e-4), so a bf16 parameter would round every update away.
    t = _train(tmp_path / "out", data, ckpt, bf16=True, learning_rate=1e-5, max_grad_norm=0.0, max_steps=2)
    assert t.loaded.source_dtype == torch.bfloat16
    # The model computed on bf16 weights; the fp32 masters lived in the optimizer's state (runtime/masters.py) with
    # fp32 moments and gradients, and the end of the run put them back into the model (what final/ was written from).
    trainable = {n: p for n, p in t.model.named_parameters() if p.requires_grad}
    assert trainable and {p.dtype for p in trainable.values()} == {torch.float32}
    states = [t.optimizer.state[p] for p in trainable.values()]
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq", "master"} for s in states)
    assert {v.dtype for s in states for v in s.values()} == {torch.float32}
    assert all(s["master"].grad is None or s["master"].grad.dtype == torch.float32 for s in states)
    for p, s in zip(trainable.values(), states):
        assert torch.equal(p.detach(), s["master"])  # the final weights are the masters, not their bf16 copies
    # The updates landed: nearly every weight of the decoder layers moved, by less than bf16 could have held.
    moved = kept_in_bf16 = total = 0
    for n, p in trainable.items():
        if ".layers." not in n or p.dim() < 2:
            continue
        w0 = before[n].float()
        moved += (p.detach() != w0).sum().item()
        kept_in_bf16 += (p.detach().to(torch.bfloat16).float() == w0).sum().item()
        total += p.numel()
    assert total and moved / total > 0.95, moved / total
    # ... and most of them would have been lost in bf16 (77% here: weights near 0 have finer bf16 steps).
    assert kept_in_bf16 / total > 0.6, "the test's updates must be below bf16's resolution to show anything"


@pytest.mark.parametrize(("adapter", "loss"), [("lora", "fused"), ("full", "fused"), ("full", "plain")])
def test_a_vision_language_checkpoint_trains_in_its_original_class(tmp_path, data, adapter, loss):
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl", torch.bfloat16)
    before = read_tensors(ckpt)
    t = _train(tmp_path / "out", data, ckpt, adapter=adapter, loss=loss, eval_steps=3)
    result = t.result
    assert result.steps == 3 and not result.interrupted
    assert t.choices.compile.value == "off" and t.objective.fused == (loss == "fused")
    base = t.model.get_base_model() if adapter == "lora" else t.model
    assert type(base).__name__ == "Qwen3_5ForConditionalGeneration"
    evals = [e["eval_loss"] for e in result.evals]
    assert len(evals) == 2 and all(torch.isfinite(torch.tensor(evals))) and evals[-1] < evals[0], evals
    # The vision tower: frozen, bf16 as saved, not one bit changed.
    vision = {n.split("model.", 1)[1]: p for n, p in base.named_parameters() if ".visual." in n}
    assert vision and all(not p.requires_grad and p.dtype == torch.bfloat16 for p in vision.values())
    assert all(torch.equal(p.detach(), before["model." + n]) for n, p in vision.items())
    trained = [p for n, p in base.named_parameters() if p.requires_grad]
    assert trained and {p.dtype for p in trained} == {torch.float32}


@pytest.mark.slow
@pytest.mark.torchrun
def test_fsdp2_trains_the_vision_language_checkpoint_as_one_process_does(tmp_path, data):
    """FSDP2 (2 gloo ranks) over a model whose frozen vision tower is bf16 and whose text model is fp32: the same
    losses as one process (FSDP2 checks the dtypes of trainable parameters only; the all-gather mixes dtypes)."""
    ckpt = make_checkpoint(tmp_path, "qwen3_5_vl", torch.bfloat16)
    common = dict(max_steps=4, gradient_accumulation_steps=2, warmup_steps=2, lr_scheduler="cosine")
    one = _train(tmp_path / "one", data, ckpt, **common).result.losses
    argv = [f"--{k}={v}" for k, v in common.items()]
    argv += ["--base_model", str(ckpt), "--dataset", data, "--output_dir", str(tmp_path / "two"), "--sequence_len=64"]
    argv += ["--eval_steps=0", "--logging_steps=1", "--val_set_size=4", "--distributed=fsdp", "--fsdp_units=auto"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "hybridtune", "train", "--nproc", "2", *argv]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    two = [r["loss"] for r in rows if r["type"] == "train"]
    assert two == pytest.approx(one, rel=1e-5)
