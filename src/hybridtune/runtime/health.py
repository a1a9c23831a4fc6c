"""Divergence: the checks that stop a run whose numbers stopped being finite, before it applies, saves or exports
them. Each raises `TrainingDiverged` (exit code 3) with the step and what to change."""

from __future__ import annotations

import math

import torch

from hybridtune.errors import TrainingDiverged
from hybridtune.runtime import distributed


def _advice(lr: float) -> str:
    return f"lower learning_rate ({lr:g}) and start again (checkpoints written before this step are kept)"


def check_step(step: int, loss: float, grad_norm: float, lr: float) -> None:
    """Before step `step`'s update: its loss and gradient norm (the update is then never applied)."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise TrainingDiverged(
            f"step {step}: the loss is {loss} and the gradient norm {grad_norm}; the run stopped before applying the "
            f"update and exports nothing; {_advice(lr)}"
        )


def check_eval(step: int, eval_loss: float, lr: float) -> None:
    """After an evaluation: finite weights whose forward overflows show here first."""
    if not math.isfinite(eval_loss):
        raise TrainingDiverged(
            f"step {step}: the eval loss is {eval_loss}; the run stopped and exports nothing; {_advice(lr)}"
        )


def check_weights(step: int, params: list[torch.nn.Parameter], d: distributed.Dist, before: str, lr: float) -> None:
    """Before a save or the export: every trained weight finite (a collective: under FSDP2 each rank holds a
    shard). The last update of a run is checked by no later step's loss, so this is where it is caught."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # this rank's shard of each
    finite = torch.stack([torch.isfinite(t).all() for t in local]).all() if local else True
    if distributed.all_max(float(not bool(finite)), d):  # one host sync, one collective
        raise TrainingDiverged(
            f"step {step}: the trained weights are not finite, so the run stopped before {before}; {_advice(lr)}"
        )
