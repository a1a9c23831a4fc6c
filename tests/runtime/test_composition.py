"""One composition root (runtime/compose.py): `hybridtune bench`'s hybridtune mode and `hybridtune train` build the
same step from the same train keys: the same model class and patch report, the same compile strategy and options
(what compile_model was asked), the same CUDA-graph setting, checkpointing and kept cores, the same optimizer and
hyperparameters, and the same loss on one batch from the same seed (tiny-qwen3_5 on the CPU; compile_model recorded,
the model run eagerly). A key flipped on one side shows up as a difference."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridtune.batch import NUM_LOSS_TOKENS
from hybridtune.bench import worker
from hybridtune.bench.modes import parse_mode
from hybridtune.config import load_config, to_dict
from hybridtune.runtime import compose
from hybridtune.train.trainer import Trainer

KEYS = "compile_regions=true,keep_mixer_cores=true,gradient_checkpointing=true,pack_layout=static"
SPEC = {
    "preset": "tiny-qwen3_5",
    "seq_len": 64,
    "layouts": 2,
    "seed": 3,
    "adapter": "lora",
    "lora_r": 4,
    "lora_targets": ["q_proj", "in_proj_qkv", "out_proj"],
    "lr": 2e-4,
    "compile_backend": "inductor",
}


@pytest.fixture
def compiles(monkeypatch):
    """compile_model recorded (strategy, options without the backend), the model left eager."""
    calls = []

    def record(model, strategy, **opts):
        opts.pop("backend", None)  # (the bench names its backend; train leaves inductor's default)
        calls.append((strategy, opts))

    monkeypatch.setattr(compose, "compile_model", record)
    return calls


@pytest.fixture
def chat_data(tmp_path) -> str:
    """A few dozen chat rows (sums), enough for train's data preparation and a held-out split."""
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a + 1}="}, {"role": "assistant", "content": str(2 * a + 1)}]}
            for a in range(48)]  # fmt: skip
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _checkpointed(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


def _bench(keys: str):
    result: dict = {}
    cfg, c, choices, batches = worker.build(SPEC, parse_mode(f"ht-loop:{keys}"), torch.device("cpu"), result)
    return cfg, c, choices, batches, result


def _train(cfg, tmp_path, data) -> Trainer:
    keys = {k: v for k, v in to_dict(cfg).items() if k not in ("dataset", "output_dir", "max_steps")}
    t = Trainer(load_config(None, {**keys, "dataset": data, "output_dir": str(tmp_path / "run"), "max_steps": 1}))
    t.setup()
    return t


def _loss(c: compose.Composed, batch: dict) -> float:
    with torch.no_grad(), c.autocast():
        return float(c.engine(batch, batch[NUM_LOSS_TOKENS]))


def _optimizer(opt: torch.optim.Optimizer) -> tuple:
    d = opt.defaults
    return type(opt), d["lr"], d["weight_decay"], d["betas"], d["eps"], d.get("fused")


def test_bench_and_train_build_the_same_step(tmp_path, chat_data, compiles):
    cfg, bench, bench_choices, batches, result = _bench(KEYS)
    t = _train(cfg, tmp_path, chat_data)
    try:
        assert len(compiles) == 2 and compiles[0] == compiles[1]  # bench first, then train
        assert compiles[0] == ("loop", {"static_shapes": True, "regional": True, "keep_cores": True})
        assert (bench.strategy, bench.compile_options) == (t.composed.strategy, t.composed.compile_options)
        assert type(bench.model) is type(t.model) and result["patch_report"] == str(t.patch_report)
        assert bench.cuda_graphs is t.cuda_graphs is False
        assert _checkpointed(bench.model) and _checkpointed(t.model)
        assert bench_choices.keep_mixer_cores.value is t.choices.keep_mixer_cores.value is True
        assert bench_choices.fused_loss.value is t.choices.fused_loss.value is True
        assert type(bench.engine.objective) is type(t.objective) and bench.engine.objective == t.objective
        assert _optimizer(compose.optimization(bench, cfg, t.total_steps).optimizer) == _optimizer(t.optimizer)
        trained = {n: p for n, p in t.model.named_parameters() if p.requires_grad}
        for n, p in bench.model.named_parameters():  # the same seed: the same weights, adapters included
            assert torch.equal(p, dict(t.model.named_parameters())[n]), n
        assert set(trained) == {n for n, p in bench.model.named_parameters() if p.requires_grad}
        assert _loss(bench, batches[0]) == _loss(t.composed, batches[0])
    finally:
        t.close()


@pytest.mark.parametrize(
    "flip,differs",
    [
        ("keep_mixer_cores=false", "keep_cores"),
        ("compile_regions=false", "regional"),
        ("pack_layout=dynamic", "static_shapes"),
    ],
)
def test_a_flipped_key_shows(flip, differs, compiles):
    """The comparison can fail: the same build with one key flipped asks compile_model for something else."""
    _bench(KEYS)
    keys = ",".join(kv for kv in KEYS.split(",") if kv.split("=")[0] != flip.split("=")[0]) + "," + flip
    _bench(keys)
    (_, same), (_, flipped) = compiles
    assert same[differs] != flipped[differs]
    assert {k: v for k, v in same.items() if k != differs} == {k: v for k, v in flipped.items() if k != differs}


def test_the_trainer_and_the_bench_share_the_step_functions():
    """The bench's step and train's step are compose.backward and compose.clip (no second copy of either)."""
    import inspect

    from hybridtune.train import trainer as trainer_mod

    for src in (inspect.getsource(worker.run_mode), inspect.getsource(trainer_mod.Trainer.train_step)):
        assert "compose_step.backward(" in src and "compose_step.clip(" in src and ".backward()" not in src
    assert dataclasses.is_dataclass(compose.Composed)
