"""The bench's step is train's step (issue 48): two optimizer steps of `hybridtune bench`'s worker (`run_mode`, an
eager ht mode) and of `hybridtune train` on the same two batches (train's own, recorded where its step hands them to
`compose.backward`) leave every trained weight and the whole optimizer state (step, exp_avg, exp_avg_sq, the fp32
masters under bf16) and the learning rate equal, bit for bit (tiny-qwen3_5 on the CPU). A full fine-tune in fp32
and under bf16 (fp32 masters in the optimizer), and LoRA."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridtune.bench import probes, worker
from hybridtune.bench.modes import parse_mode
from hybridtune.config import load_config, to_dict
from hybridtune.runtime import compose
from hybridtune.train import trainer as trainer_mod

STEPS = 2  # the schedule's warmup moves the rate between them
SPEC = {
    "kind": "mode",
    "mode": "ht-eager",
    "preset": "tiny-qwen3_5",
    "seq_len": 64,
    "layouts": 2,
    "seed": 3,
    "lora_r": 4,
    "lora_targets": ["q_proj", "in_proj_qkv", "out_proj"],
    "lr": 2e-4,
    "warmup": 1,
    "steps": STEPS - 1,
}


def _copy(batch: dict) -> dict:
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}


def _snapshot(params: list, opt: torch.optim.Optimizer) -> dict:
    """The trained weights and the optimizer's state of each (positional: both sides' trainable parameters come in
    the engine's order), and each group's learning rate."""
    return {
        "weights": [p.detach().clone() for p in params],
        "state": [{k: v.detach().clone() for k, v in opt.state[p].items()} for p in params],
        "lr": [float(g["lr"]) for g in opt.param_groups],
        "optimizer": type(opt).__name__,
    }


@pytest.fixture
def optimizers(monkeypatch):
    """Every optimizer train and the bench build, with the trainable parameters it was built over."""
    built = []
    original = compose.optimization

    def record(c, *args, **kwargs):
        o = original(c, *args, **kwargs)
        built.append((c.trainable(), o.optimizer))
        return o

    monkeypatch.setattr(compose, "optimization", record)
    return built


def _train(cfg, tmp_path, optimizers, monkeypatch) -> tuple[list[dict], dict]:
    """train's run of STEPS steps on its bundled data: the batches its steps trained on and its state after the last
    step."""
    batches, after = [], {}
    backward = compose.backward

    def recording(c, mine, *args, **kwargs):
        batches.extend(_copy(b) for b in mine)
        return backward(c, mine, *args, **kwargs)

    def on_log(rec: dict) -> None:
        if rec["step"] == STEPS:  # before the end of the run merges the masters into the model
            params, opt = optimizers[-1]
            after.update(_snapshot(params, opt))

    monkeypatch.setattr(compose, "backward", recording)
    keys = {k: v for k, v in to_dict(cfg).items() if k not in ("dataset", "output_dir", "max_steps")}
    run = {"output_dir": str(tmp_path / "run"), "max_steps": STEPS, "val_set_size": 0}
    trainer_mod.train(load_config(None, {**keys, **run}, warn=False), on_log)
    monkeypatch.setattr(compose, "backward", backward)
    return batches, after


def _bench(spec: dict, mode, batches: list[dict], optimizers, monkeypatch) -> dict:
    """The bench worker's run of the mode (one warm-up and one timed step) on train's batches: its state after."""
    monkeypatch.setattr(worker, "parse_mode", lambda _: mode)
    monkeypatch.setattr(worker, "make_batches", lambda *a: [_copy(b) for b in batches])
    monkeypatch.setattr(probes, "flops", lambda *a, **k: None)  # (train's batches carry no bench doc_lens)
    result = worker.run_mode(spec)
    assert result["losses"] and len(result["losses"]) == STEPS
    params, opt = optimizers[-1]
    return _snapshot(params, opt)


def _differences(benched: dict, trained: dict) -> list[str]:
    """What differs between the bench's state and train's: a line each (equal: bit for bit, dtype included)."""
    out = [f"{k}: bench {benched[k]} train {trained[k]}" for k in ("optimizer", "lr") if benched[k] != trained[k]]
    if len(benched["weights"]) != len(trained["weights"]):
        return [*out, f"{len(benched['weights'])} trained weights in the bench, {len(trained['weights'])} in train"]
    for i, (b, t) in enumerate(zip(benched["weights"], trained["weights"])):
        if b.dtype != t.dtype or not torch.equal(b, t):
            out.append(f"weight {i}: bench {b.dtype} train {t.dtype}, max |diff| {_gap(b, t)}")
    for i, (b, t) in enumerate(zip(benched["state"], trained["state"])):
        if set(b) != set(t):
            out.append(f"state {i}: bench {sorted(b)} train {sorted(t)}")
        for k in set(b) & set(t):
            if b[k].dtype != t[k].dtype or not torch.equal(b[k], t[k]):
                out.append(f"state {i} {k}: bench {b[k].dtype} train {t[k].dtype}, max |diff| {_gap(b[k], t[k])}")
    return out


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max()) if a.shape == b.shape else float("nan")


@pytest.mark.parametrize(
    "adapter,bf16", [("full", False), ("full", True), ("lora", False)], ids=["full-fp32", "full-bf16", "lora"]
)
def test_the_bench_steps_as_train_does(adapter, bf16, tmp_path, optimizers, monkeypatch):
    mode = parse_mode(SPEC["mode"])
    mode = dataclasses.replace(mode, train={**mode.train, "bf16": bf16})
    spec = {**SPEC, "adapter": adapter}
    cfg = worker.train_config(spec, mode)
    batches, trained = _train(cfg, tmp_path, optimizers, monkeypatch)
    assert len(batches) == STEPS and trained
    benched = _bench(spec, mode, batches, optimizers, monkeypatch)
    assert len(optimizers) == 2  # train's, then the bench's
    assert len(trained["weights"]) > 0
    assert _differences(benched, trained) == []
    if bf16 and adapter == "full":  # the bf16 weights' fp32 masters are in the state: what the bench must step
        assert all("master" in s for s in trained["state"])
