"""The logged step: the loss averaged over the logging window, `step N/TOTAL` and the time left in the plain log
line (not on a terminal), and `--max_steps 0` (evaluate and export the starting model)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.models.loading import load_model, tokenizer_for
from hybridtune.runtime.adapter_kind import LORA
from hybridtune.runtime.metrics import StepLog, Throughput, format_step
from train_runs import metrics_rows, run


def settings(out: Path, data: str, **kw) -> dict:
    return {
        "dataset": data,
        "sequence_len": 64,
        "val_set_size": 8,
        "eval_steps": 0,
        "warmup_steps": 1,
        "device": "cpu",
        "output_dir": str(out),
        **kw,
    }


def test_step_log_window_mean_and_time_left(monkeypatch):
    # perf_counter, call by call: the start (100), step 1's end (112, this process's first step), step 3's (120)
    clock = iter([100.0, 100.0, 112.0, 112.0, 112.0, 120.0, 120.0])
    monkeypatch.setattr("hybridtune.runtime.metrics.time.perf_counter", lambda: next(clock))
    log = StepLog(total_steps=10, done=0, logging_steps=3)
    got = []
    for step, loss in zip(range(1, 4), [4.0, 3.0, 2.0]):
        rec = {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3, "tokens": 10, "model_flops": 0.0}
        log.add(rec)
        if log.due(step, stop=False):
            got.append(log.log(rec, 0.5, None))
    assert got[0]["eta_s"] == pytest.approx(9 * 12.0)  # one step done: its 12 s (compilation included) x 9
    assert got[0]["first_step_s"] == pytest.approx(12.0) and "first_step_s" not in got[1]  # the first step's own
    assert [r["step"] for r in got] == [1, 3]
    # Step 1 alone; then steps 2 and 3 averaged (not step 3's own loss), which stays as step_loss.
    assert (got[0]["loss"], got[0]["loss_steps"]) == (4.0, 1)
    assert (got[1]["loss"], got[1]["step_loss"], got[1]["loss_steps"]) == (2.5, 2.0, 2)
    assert got[1]["total_steps"] == 10
    # Time left at step 3 (logged at 120): 2 steps took 120 - 112 = 8 s after the first, so 7 steps x 4 s.
    assert got[1]["eta_s"] == pytest.approx(28.0)


def test_trainer_logs_the_window_mean_and_keeps_each_step(tmp_path, small_data):
    result = run(load_config(None, settings(tmp_path / "run", small_data, max_steps=5, logging_steps=2)))
    logged = metrics_rows(tmp_path / "run", "train")
    assert [r["step"] for r in logged] == [1, 2, 4, 5]  # every 2 steps, the first and the last
    per_step = result.losses  # each optimizer step's own loss, in order
    for r, window in zip(logged, [[1], [2], [3, 4], [5]]):
        mean = sum(per_step[s - 1] for s in window) / len(window)
        assert r["loss"] == pytest.approx(mean, rel=1e-12) and r["loss_steps"] == len(window)
        assert r["step_loss"] == per_step[r["step"] - 1]
    assert logged[2]["loss"] != logged[2]["step_loss"]  # a real window: the mean is not the last step's loss


def test_plain_step_line_has_total_and_time_left(tmp_path, small_data, capsys):
    """Outside a terminal (the captured stderr here, a log file, CI) every logged step says N/TOTAL and the time
    left; no progress bar is drawn."""
    argv = [f"--{k}={v}" for k, v in settings(tmp_path / "run", small_data, max_steps=4, logging_steps=2).items()]
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if " step " in x and "loss" in x and "eval" not in x]
    line = re.compile(
        r"INFO step +(\d+)/4  loss \d+\.\d{4}  grad_norm \d+\.\d{3}  lr \S+  tok/s [\d,]+  .*mem \d+\.\d\d GiB  "
        r"eta \d+:\d\d:\d\d(  first step \d+\.\d s)?$"
    )
    assert [int(line.search(x).group(1)) for x in lines] == [1, 2, 4], lines
    assert lines[-1].endswith("eta 0:00:00")
    assert "first step" in lines[0] and not any("first step" in x for x in lines[1:])  # compiling included, once
    assert "━" not in err and "train " not in err  # no progress bar (rich) outside a terminal


def test_max_steps_0_evaluates_and_exports_the_starting_model(tmp_path, small_data, capsys):
    out = tmp_path / "run"
    argv = [f"--{k}={v}" for k, v in settings(out, small_data, max_steps=0, warmup_steps=10).items()]
    assert main(["train", *argv]) == 0
    err = capsys.readouterr().err
    assert "warmup_steps" not in err  # no warning about a warmup longer than a run that trains nothing
    assert metrics_rows(out, "train") == []
    evals = metrics_rows(out, "eval")
    assert [r["step"] for r in evals] == [0] and evals[0]["eval_examples"] == 8  # one eval, not two
    assert not list(out.glob("checkpoint-*"))
    # final/ holds the starting model: the preset's seeded initialisation, bit for bit.
    cfg = load_config(None, settings(out, small_data))
    start = load_model(cfg.base_model, tokenizer_for(cfg.base_model), seed=cfg.seed).model.state_dict()
    saved = load_file(out / "final" / "model.safetensors")
    assert saved and all(torch.equal(saved[k], start[k].to(saved[k].dtype)) for k in saved)
    assert "done: max_steps 0, nothing trained: the starting model evaluated and exported; final model in" in err


def test_max_steps_below_minus_1_is_refused():
    from hybridtune.errors import ConfigError

    with pytest.raises(ConfigError, match=r"'max_steps' = -2 must be -1 \(from num_epochs\), 0"):
        load_config(None, {"max_steps": -2})


def test_step_flops_charges_the_lora_peft_applied_expert_lora_included():
    """MFU's FLOP count takes the LoRA peft really placed: LoRA on the routed experts (target_parameters) adds its
    per-expert FLOPs, equal to the count's own for those parameters; without it the count is the attention/GDN/MLP
    LoRA alone."""
    from hybridtune.models.flops import step_flops
    from hybridtune.models.patching import patch_model
    from hybridtune.runtime.lora import lora_from_config
    from hybridtune.runtime.metrics import StepFlops

    def flops(**keys):
        cfg = load_config(None, dict(base_model="tiny-qwen3_5_moe", adapter="lora", lora_dropout=0.0, **keys))
        model = load_model("tiny-qwen3_5_moe").model
        patch_model(model)
        return StepFlops(lora_from_config(model, cfg), LORA, cfg.lora_r, cfg.lora_target_modules), cfg

    docs = [97, 31]
    with_experts, cfg = flops(lora_target_parameters=["gate_up_proj", "down_proj"])
    without, _ = flops()
    assert with_experts.kw["lora_parameters"] == ["down_proj", "gate_up_proj"]
    assert without.kw["lora_parameters"] == []
    want = step_flops(
        with_experts.config, docs, adapter="lora", lora_r=cfg.lora_r, lora_targets=with_experts.kw["lora_targets"],
        lora_parameters=["gate_up_proj", "down_proj"],
    )  # fmt: skip
    assert with_experts(docs) == (want.model, want.model) and want.model > without(docs)[0]
    # with checkpointing on (as the out-of-memory retry switches it), the hardware FLOPs add the recompute
    with_experts.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    recompute = step_flops(
        with_experts.config, docs, adapter="lora", lora_r=cfg.lora_r, lora_targets=with_experts.kw["lora_targets"],
        lora_parameters=["gate_up_proj", "down_proj"], gradient_checkpointing=True,
    )  # fmt: skip
    assert with_experts(docs) == (want.model, recompute.hardware) and recompute.hardware > want.model


def test_throughput_hfu_counts_the_recompute_and_the_line_shows_it_where_it_differs(monkeypatch):
    clock = iter([0.0, 2.0, 4.0])
    monkeypatch.setattr("hybridtune.runtime.metrics.time.perf_counter", lambda: next(clock))
    t = Throughput(peak_flops=1e12)
    t.add(100, flops=6e11, hardware=8e11)
    t.add(100, flops=2e11)  # no hardware figure: no recompute, the model FLOPs
    got = t.take()
    assert got["mfu"] == pytest.approx(0.4) and got["hfu"] == pytest.approx(0.5)
    assert got["step_s"] == pytest.approx(1.0)  # 2 s over the window's 2 steps
    t.add(10, flops=2e11)
    same = t.take()
    assert same["hfu"] == same["mfu"] == pytest.approx(0.1)
    rec = {"step": 3, "loss": 1.0, "grad_norm": 1.0, "lr": 1e-3, "tokens_per_s": 1.0, "mem_gib": 1.0}
    assert "hfu 50.0%" in format_step(rec | got) and "mfu 40.0%" in format_step(rec | got)
    assert "hfu" not in format_step(rec | same)
