"""The objectives the config knows: each name with what the layers below the trainer read of it
(`ObjectiveTraits`: what its data rows are, whether its sequences are sampled during the step, the files beside the
data that its run's identity hashes, the config keys it owns). The config's `objective` is checked against this registry (did-you-mean);
`train.objectives.register_objective` adds an objective's traits here beside its spec, so an objective registered
from outside src/ (a test's) is a config value like the built-ins listed below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields

from hybridtune.config.grpo import GRPOKeys, reward_file
from hybridtune.errors import did_you_mean


def _no_files(cfg) -> list[str]:
    return []


def _reward_files(cfg) -> list[str]:
    """grpo's reward_funcs files, as written (a built-in names none)."""
    return [f for f in dict.fromkeys(reward_file(spec) for spec in cfg.reward_funcs) if f]


@dataclass(frozen=True)
class ObjectiveTraits:
    """What the config, the defaults (runtime/defaults.py) and the run record (run/outdir.py) know of an objective."""

    name: str
    unit: str = "examples"  # what its training rows are, as the defaults' log lines count them: examples, pairs
    sampled: bool = False  # its trained sequences are sampled during the step (on-policy): its rows are prompts
    identity_files: Callable[..., list[str]] = field(default=_no_files)  # cfg -> files its run's identity hashes
    keys: tuple[str, ...] = ()  # the config keys it owns (set for another objective: one line, `owners`)
    loss_types: tuple[str, ...] = ()  # the values its `loss_type` takes (besides auto), when it owns the key

    @property
    def packed(self) -> bool:
        """Whether its rows are packed into sequence_len bins (sampled objectives pack their completions)."""
        return not self.sampled


_KNOWN: dict[str, ObjectiveTraits] = {
    t.name: t
    for t in (
        ObjectiveTraits("sft"),
        ObjectiveTraits(
            "dpo",
            unit="pairs",
            keys=("beta", "loss_type", "label_smoothing", "rpo_alpha"),
            loss_types=("sigmoid", "ipo", "hinge", "robust"),
        ),
        ObjectiveTraits("simpo", unit="pairs", keys=("beta", "label_smoothing", "rpo_alpha", "simpo_gamma")),
        ObjectiveTraits("orpo", unit="pairs", keys=("beta",)),
        ObjectiveTraits(
            "grpo",
            unit="prompts",
            sampled=True,
            identity_files=_reward_files,
            keys=("beta", "loss_type", *(f.name for f in fields(GRPOKeys))),
            loss_types=("grpo", "dr_grpo", "dapo"),
        ),
    )
}
# The objectives that train on preference pairs (prompt, chosen, rejected), packed whole (data/pairs.py).
PAIR_OBJECTIVES = tuple(n for n, t in _KNOWN.items() if t.unit == "pairs")


def register_traits(traits: ObjectiveTraits) -> None:
    """Make `traits.name` a value of the config's `objective` (a later registration of the name replaces it)."""
    _KNOWN[traits.name] = traits


def objective_names() -> tuple[str, ...]:
    return tuple(_KNOWN)


def objective_traits(name: str) -> ObjectiveTraits:
    """The traits of a known objective (`known_objective` has checked the config's name)."""
    return _KNOWN[name]


def known_objective(name) -> bool:
    return isinstance(name, str) and name in _KNOWN


def owned_keys() -> tuple[str, ...]:
    """Every config key some objective owns, in the order the registry first names them."""
    return tuple(dict.fromkeys(k for t in _KNOWN.values() for k in t.keys))


def owners(key: str) -> tuple[str, ...]:
    """The objectives that own config key `key`."""
    return tuple(n for n, t in _KNOWN.items() if key in t.keys)


def unknown_objective(name) -> str:
    """What the config says of an unknown `objective` (after "config key 'objective' = ...")."""
    return f"must be one of: {', '.join(_KNOWN)}.{did_you_mean(str(name), _KNOWN)}"
