"""What a run minimises (`objective`) and the two keys whose meaning is the objective's:

  objective   beta (TRL's name)                              loss_type
  sft         (unused)                                       (unused)
  dpo         the implicit reward's scale                    sigmoid, ipo, hinge or robust (auto: sigmoid)
  simpo       the length-normalised reward's scale           (unused: sigmoid, with simpo_gamma's margin)
  orpo        the odds-ratio term's weight                   (unused)
  grpo        the KL coefficient (0 = none)                  grpo, dr_grpo or dapo (auto: dapo)

The keys only one objective reads are its own module's: preference.py (dpo, simpo, orpo), grpo.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import Bound, key
from hybridtune.config.preference import trl_range

# The objectives that train on preference pairs (prompt, chosen, rejected), packed whole (data/pairs.py).
PAIR_OBJECTIVES = ("dpo", "simpo", "orpo")


@dataclass
class ObjectiveKeys:
    objective: Literal["sft", "dpo", "simpo", "orpo", "grpo"] = key(
        "sft",
        "what training minimises: sft = next-token cross-entropy on the trained tokens; dpo, simpo, orpo = "
        "preference tuning on prompt/chosen/rejected pairs; grpo = RL on rewarded samples",
    )
    beta: float = key(
        0.1,
        "dpo/simpo/orpo: the preference term's strength (TRL's beta); grpo: KL coefficient (0 = none)",
        Bound(lambda v, cfg: v > 0 or (v == 0 and cfg.objective == "grpo"), "must be > 0 (grpo: >= 0)"),
        trl_range(),
    )
    loss_type: Literal["auto", "sigmoid", "ipo", "hinge", "robust", "grpo", "dr_grpo", "dapo"] = key(
        "auto", "dpo: sigmoid, ipo, hinge or robust (auto: sigmoid); grpo: grpo, dr_grpo or dapo (auto: dapo)"
    )
