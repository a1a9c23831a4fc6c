"""An objective as a unit: `ObjectiveSpec` carries what an objective needs beyond its loss (its data loading and
checks, its collator, its rollouts when on-policy, its own data preview, the errors after which a run keeps the
steps done) beside the builder of its `runtime.objective.Objective`, and its `config_objectives.ObjectiveTraits`
(what the config and the layers below the trainer know of it). The trainer, `hybridtune data` and the bench ask
the run's spec (`spec_of`); none of them names an objective. `register_objective` is the one way in: the built-ins'
table is in `__init__.py`, and a test may register its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hybridtune.config import (
    ObjectiveTraits,
    TrainConfig,
    objective_names,
    objective_traits,
    owned_keys,
    owners,
    register_traits,
)
from hybridtune.data import PackedCollator
from hybridtune.data.build import PreparedData, load_data
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.runtime.objective import Objective

# (cfg, tokenizer, vision) -> what `prepare` takes; it has `train_lengths()` (the defaults' sequence_len reads them)
Load = Callable[[Any, Any, Any], Any]
# (cfg, tokenizer, loaded) -> the run's bins and held-out examples
Prepare = Callable[[Any, Any, Any], PreparedData]


def packed_collator(data: PreparedData) -> type[PackedCollator]:
    return PackedCollator


@dataclasses.dataclass(frozen=True)
class ObjectiveSpec:
    """One objective (see the module doc). `build(cfg, fused_loss, model)` is its `Objective`; `model` the run's model
    as built (a full fine-tune's reference is a frozen copy of it). `collator(data)` is the collator class of its
    bins (called with `layout=` and `pad_token_id=`). `rollouts`, for an on-policy objective: `(cfg, objective,
    tokenizer, model, device, autocast, world)` -> what gives each step's window (`window(stream, micro_batches,
    step)` and the window's document lengths `lens`). `preview(cfg, tokenizer, vision, rows, out)`: its own
    `hybridtune data` output (None: the rows as trained, data_preview.py's). `keeps_steps`: errors of the user's code
    it runs (a reward function) after which the trainer saves the steps done before it stops. `bench_packs(seq_len,
    layouts, vocab_size, seed)`: `hybridtune bench`'s packs of its documents for the bench's document lengths
    `layouts` (None: the bench's own, random documents, or its preference pairs for an objective of pairs)."""

    traits: ObjectiveTraits
    build: Callable[..., Objective]
    load: Load = load_data
    prepare: Prepare | None = None
    collator: Callable[[PreparedData], type[PackedCollator]] = packed_collator
    rollouts: Callable[..., Any] | None = None
    preview: Callable[..., PreparedData] | None = None
    keeps_steps: tuple[type[BaseException], ...] = ()
    bench_packs: Callable[[int, list[list[int]], int, int], list[list[Any]]] | None = None

    @property
    def name(self) -> str:
        return self.traits.name


OBJECTIVES: dict[str, ObjectiveSpec] = {}  # every registered objective by name


def check_keys(cfg: TrainConfig) -> None:
    """Keys another objective owns (`config_objectives.ObjectiveTraits.keys`), set for this one, are one line each,
    before anything loads; so is a `loss_type` that is not one of this objective's."""
    defaults, traits = TrainConfig(), objective_traits(cfg.objective)
    for key in owned_keys():
        if getattr(cfg, key) != getattr(defaults, key) and key not in traits.keys:
            raise ConfigError(
                f"config key '{key}' is set but means nothing for objective '{cfg.objective}' (it is for "
                f"{' and '.join(owners(key))}); remove it or set objective"
            )
    if cfg.loss_type != "auto" and traits.loss_types and cfg.loss_type not in traits.loss_types:
        raise ConfigError(
            f"config key 'loss_type' = '{cfg.loss_type}' is not a loss of objective '{cfg.objective}'; use one of "
            f"{', '.join(traits.loss_types)} (or auto)"
        )
    if cfg.label_smoothing and cfg.loss_type in ("hinge", "ipo"):
        raise ConfigError(f"config key 'label_smoothing' has no meaning for loss_type '{cfg.loss_type}'; remove it")


def register_objective(spec: ObjectiveSpec) -> ObjectiveSpec:
    """Make `spec` the objective of its name, for the config (`objective: <name>`) and the trainer alike."""
    if spec.prepare is None:
        raise ValueError(f"objective '{spec.name}': its spec needs a `prepare` (its data's bins)")
    register_traits(spec.traits)
    OBJECTIVES[spec.name] = spec
    return spec


def spec_of(name: str) -> ObjectiveSpec:
    """The spec of the objective called `name` (the config's `objective`)."""
    if name not in OBJECTIVES:
        raise ConfigError(
            f"objective '{name}' is not one of: {', '.join(objective_names())}.{did_you_mean(name, objective_names())}"
        )
    return OBJECTIVES[name]
