"""The keys only the preference objectives read (`objective: dpo | simpo | orpo`, TRL's names): conservative DPO's
label smoothing, the added NLL term (`rpo_alpha`) and SimPO's margin; their shared `beta` and `loss_type` are
`objective.py`'s."""

from __future__ import annotations

from dataclasses import dataclass

from hybridtune.config.keys import Bound, at_least, in_range, key

# The preference objectives' strengths and margin (TRL's values run from about 0.01 to 10): far past them the
# gradient overflows, and the run stopped saying the model's numbers overflow on this data (try bf16: false).
MAX_PREFERENCE = 1e3


def trl_range() -> Bound:
    """A strength or margin within MAX_PREFERENCE (null passes), checked for a config about to train."""
    return Bound(
        lambda v, cfg: abs(v or 0) <= MAX_PREFERENCE,
        f"must be at most {MAX_PREFERENCE:g} (TRL's values are 0.01 to 10)",
        training=True,
    )


@dataclass
class PreferenceKeys:
    label_smoothing: float = key(
        0.0,
        "dpo/simpo: the assumed share of flipped preference labels (conservative DPO)",
        in_range(0, 0.5, "must be in [0, 0.5)"),
    )
    rpo_alpha: float | None = key(
        None,
        "dpo/simpo: weight of an added NLL term on the chosen replies (TRL's rpo_alpha)",
        at_least(0, "must be null (off) or >= 0"),
        trl_range(),
    )
    simpo_gamma: float = key(0.5, "simpo: the target reward margin", at_least(0, "must be >= 0"), trl_range())
