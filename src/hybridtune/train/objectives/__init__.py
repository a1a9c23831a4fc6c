"""Training objectives, one module each, behind the `runtime.objective.Objective` protocol.

`OBJECTIVES` maps the config's `objective` value to a builder taking the run's config and resolved choices; a new
objective is a module here plus one line in that table.
"""

from __future__ import annotations

from collections.abc import Callable

from hybridtune.config import TrainConfig
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.runtime.objective import Objective
from hybridtune.train.objectives.sft import SFT


def _sft(cfg: TrainConfig, fused_loss: bool) -> Objective:
    return SFT(fused=fused_loss)


OBJECTIVES: dict[str, Callable[[TrainConfig, bool], Objective]] = {"sft": _sft}


def build_objective(cfg: TrainConfig, fused_loss: bool) -> Objective:
    """The run's objective from `cfg.objective`; `fused_loss` is the resolved `loss` choice."""
    name = cfg.objective
    if name not in OBJECTIVES:
        raise ConfigError(
            f"objective '{name}' is not one of: {', '.join(OBJECTIVES)}.{did_you_mean(name, OBJECTIVES)}"
        )
    return OBJECTIVES[name](cfg, fused_loss)


__all__ = ["OBJECTIVES", "SFT", "build_objective"]
