"""Divergence: the checks that stop a run whose numbers stopped being finite, before it applies, saves or exports
them. Each raises `TrainingDiverged` (exit code 3) with the step and what to change; a base model whose own weights
are not finite, found at the first step (before any update), is a `ModelError` (exit code 2): bad input."""

from __future__ import annotations

import math

import torch

from hybridtune.errors import ModelError, TrainingDiverged
from hybridtune.runtime import distributed


def _advice(lr: float) -> str:
    return f"lower learning_rate ({lr:g}) and start again (checkpoints written before this step are kept)"


# What wrappers (peft, FSDP, activation checkpointing, torch.compile) add to a parameter's name as saved.
_WRAPPERS = ("base_model.model.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.", "base_layer.")


def first_nonfinite(model: torch.nn.Module, d: distributed.Dist) -> str | None:
    """The name (as saved) of the first parameter of `model` holding a NaN or an infinity, None when all are finite.
    A collective: under FSDP2 each rank holds a shard of each, and every rank gets the same answer."""
    named = list(model.named_parameters())
    local = [p.to_local() if hasattr(p, "to_local") else p for _, p in named]  # this rank's shard of each
    bad = (i for i, t in enumerate(local) if t.is_floating_point() and not bool(torch.isfinite(t).all()))
    first = int(-distributed.all_max(-float(next(bad, len(named))), d))  # the smallest index over ranks
    if first >= len(named):
        return None
    name = named[first][0]
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def _before_any_update(what: str, model: torch.nn.Module, d: distributed.Dist) -> None:
    """A loss that is not finite before any update: the learning rate cannot be the cause. A base model whose own
    weights are not finite is bad input (ModelError); finite weights whose numbers overflow are said as such."""
    bad = first_nonfinite(model, d)
    if bad is not None:
        raise ModelError(
            f"{what} before any update because the base model's weights are not finite ('{bad}' holds NaN or inf); "
            "the run stopped and trained nothing; give base_model a model whose weights are finite"
        )
    raise TrainingDiverged(
        f"{what} before any update, with finite weights, so the learning rate is not the cause: the model's "
        "numbers overflow on this data (under bf16 autocast, try bf16: false); the run stopped and trained nothing"
    )


def check_step(
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    model: torch.nn.Module | None = None,
    d: distributed.Dist = distributed.ONE,
) -> None:
    """Before step `step`'s update: its loss and gradient norm (the update is then never applied). At step 1 with
    `model` given, no update has been applied yet: its weights are looked at (a collective over `d`)."""
    if math.isfinite(loss) and math.isfinite(grad_norm):
        return
    what = f"step {step}: the loss is {loss} and the gradient norm {grad_norm}"
    if step == 1 and model is not None:
        _before_any_update(what, model, d)
    raise TrainingDiverged(f"{what}; the run stopped before applying the update and exports nothing; {_advice(lr)}")


def check_eval(
    step: int, eval_loss: float, lr: float, model: torch.nn.Module | None = None, d: distributed.Dist = distributed.ONE
) -> None:
    """After an evaluation: finite weights whose forward overflows show here first. At step 0 with `model` given
    (the evaluation before training), its weights are looked at as in `check_step`."""
    if math.isfinite(eval_loss):
        return
    what = f"step {step}: the eval loss is {eval_loss}"
    if step == 0 and model is not None:
        _before_any_update(what, model, d)
    raise TrainingDiverged(f"{what}; the run stopped and exports nothing; {_advice(lr)}")


def check_weights(step: int, params: list[torch.nn.Parameter], d: distributed.Dist, before: str, lr: float) -> None:
    """Before a save or the export: every trained weight finite (a collective: under FSDP2 each rank holds a
    shard). The last update of a run is checked by no later step's loss, so this is where it is caught."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]  # this rank's shard of each
    finite = torch.stack([torch.isfinite(t).all() for t in local]).all() if local else True
    if distributed.all_max(float(not bool(finite)), d):  # one host sync, one collective
        raise TrainingDiverged(
            f"step {step}: the trained weights are not finite, so the run stopped before {before}; {_advice(lr)}"
        )
