"""Training objectives, one module each, behind the `runtime.objective.Objective` protocol.

`OBJECTIVES` maps the config's `objective` value to a builder taking the run's config, the resolved `loss` choice and
the model as built; a new objective is a module here plus one line in that table (sft.py; dpo.py for dpo, simpo and
orpo, with preference.py; grpo.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hybridtune.config import TrainConfig
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.runtime.objective import Objective
from hybridtune.train.objectives.dpo import Preference, build_preference
from hybridtune.train.objectives.grpo import GRPO, build_grpo
from hybridtune.train.objectives.sft import SFT


def _sft(cfg: TrainConfig, fused_loss: bool, model: torch.nn.Module | None = None) -> Objective:
    return SFT(fused=fused_loss)


OBJECTIVES: dict[str, Callable[..., Objective]] = {
    "sft": _sft,
    "dpo": build_preference,
    "simpo": build_preference,
    "orpo": build_preference,
    "grpo": build_grpo,
}


def build_objective(cfg: TrainConfig, fused_loss: bool, model: torch.nn.Module | None = None) -> Objective:
    """The run's objective from `cfg.objective`; `fused_loss` is the resolved `loss` choice; `model`, the run's model
    as built (before any training), where the objective keeps something of it (a full fine-tune's dpo reference)."""
    name = cfg.objective
    if name not in OBJECTIVES:
        raise ConfigError(f"objective '{name}' is not one of: {', '.join(OBJECTIVES)}.{did_you_mean(name, OBJECTIVES)}")
    return OBJECTIVES[name](cfg, fused_loss, model)


__all__ = ["GRPO", "OBJECTIVES", "SFT", "Preference", "build_objective"]
