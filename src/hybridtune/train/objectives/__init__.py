"""Training objectives, one module each, behind the `runtime.objective.Objective` protocol, each a unit: its
`spec.ObjectiveSpec` (its builder, data, collator, rollouts, preview) registered by `register_objective`.

`BUILTIN` is the table of hybridtune's own (sft.py; dpo.py for dpo, simpo and orpo, with preference.py; grpo.py with
grpo_rollouts.py and rewards.py); a new objective is its module(s) plus one line here (and its traits' line in
config_objectives.py, so that a config names it before the trainer is imported). `OBJECTIVES` maps every registered
name to its spec; `build_objective` builds the run's.
"""

from __future__ import annotations

import torch

from hybridtune.config import TrainConfig, objective_traits
from hybridtune.runtime.objective import Objective
from hybridtune.train.objectives.dpo import Preference, build_preference
from hybridtune.train.objectives.grpo import GRPO, build_grpo
from hybridtune.train.objectives.grpo_rollouts import Rollouts, load_prompts, prepare_prompts, preview_prompts
from hybridtune.train.objectives.preference import collator_for, prepare_data
from hybridtune.train.objectives.rewards import RewardError
from hybridtune.train.objectives.sft import SFT
from hybridtune.train.objectives.spec import OBJECTIVES, ObjectiveSpec, check_keys, register_objective, spec_of


def _sft(cfg: TrainConfig, fused_loss: bool, model: torch.nn.Module | None = None) -> Objective:
    return SFT(fused=fused_loss)


def _rows(name: str, build) -> ObjectiveSpec:  # supervised rows or preference pairs (preference.py checks which)
    return ObjectiveSpec(objective_traits(name), build, prepare=prepare_data, collator=collator_for)


BUILTIN = (
    _rows("sft", _sft),
    _rows("dpo", build_preference),
    _rows("simpo", build_preference),
    _rows("orpo", build_preference),
    ObjectiveSpec(
        objective_traits("grpo"),
        build_grpo,
        load=load_prompts,
        prepare=prepare_prompts,
        rollouts=Rollouts,
        preview=preview_prompts,
        keeps_steps=(RewardError,),
    ),  # fmt: skip
)
for _spec in BUILTIN:
    register_objective(_spec)


def build_objective(cfg: TrainConfig, fused_loss: bool, model: torch.nn.Module | None = None) -> Objective:
    """The run's objective from `cfg.objective`; `fused_loss` is the resolved `loss` choice; `model`, the run's model
    as built (before any training), where the objective keeps something of it (a full fine-tune's dpo reference)."""
    return spec_of(cfg.objective).build(cfg, fused_loss, model)


__all__ = ["GRPO", "OBJECTIVES", "SFT", "ObjectiveSpec", "Preference", "build_objective", "check_keys",
           "register_objective", "spec_of"]  # fmt: skip
