"""The objective seam: the engine computes whatever objective it is given, SFT is today's loss unchanged, and an
unknown objective is one line."""

from __future__ import annotations

import ast
import dataclasses
import inspect

import pytest
import torch

from hybridtune.config import TrainConfig
from hybridtune.errors import ConfigError
from hybridtune.runtime.distributed import LossModule
from hybridtune.runtime.objective import Objective
from hybridtune.train import setup, trainer
from hybridtune.train.objectives import OBJECTIVES, SFT, build_objective


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))


@dataclasses.dataclass(frozen=True)
class _SquaredWeights:
    name: str = "squared"
    batch_keys: frozenset = frozenset({"scale"})
    needs_reference: bool = False
    needs_generation: bool = False

    def window_items(self, batches):
        return len(batches)

    def loss(self, model, batch, num_items):
        return batch["scale"] * (model.w**2).sum() / num_items

    def step_metrics(self, d=None):
        return {}


def test_the_engine_computes_the_objective_it_is_given():
    torch.manual_seed(0)
    model = _Tiny()
    objective = _SquaredWeights()
    assert isinstance(objective, Objective)  # the protocol is all an objective needs
    engine = LossModule(model, objective)
    loss = engine({"scale": torch.tensor(3.0)}, 2)
    loss.backward()
    torch.testing.assert_close(loss, 3.0 * (model.w.detach() ** 2).sum() / 2)
    torch.testing.assert_close(model.w.grad, 3.0 * model.w.detach())  # d/dw of 1.5 w^2


def test_an_engine_without_objective_refuses_a_loss():
    with pytest.raises(RuntimeError, match="without an objective"):
        LossModule(_Tiny())({"scale": torch.tensor(1.0)}, 1)


def test_build_objective_takes_the_config_and_the_loss_choice():
    sft = build_objective(TrainConfig(), fused_loss=False)
    assert sft == SFT(fused=False) and isinstance(sft, Objective)
    assert build_objective(TrainConfig(), fused_loss=True).fused
    assert {"sft", "dpo", "simpo", "orpo", "grpo"} <= set(OBJECTIVES)  # (and any a test registered)


def test_an_unknown_objective_is_one_line():
    cfg = dataclasses.replace(TrainConfig(), objective="kto")  # past the config's own check, as a caller could
    with pytest.raises(ConfigError, match="objective 'kto' is not one of: sft, dpo, simpo, orpo, grpo"):
        build_objective(cfg, fused_loss=True)


def test_the_trainer_names_no_objective():
    """trainer.py and setup.py ask the run's spec: they import no objective's module and name no objective."""
    names = set(OBJECTIVES)
    for module in (trainer, setup):
        tree = ast.parse(inspect.getsource(module))
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {m for m in imported if m.startswith("hybridtune.train.objectives.")}, module.__name__
        said = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not said & names, (module.__name__, said & names)
