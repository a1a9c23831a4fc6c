"""What a run minimises (`objective`) and the two keys whose meaning is the objective's:

  objective   beta (TRL's name)                              loss_type
  sft         (unused)                                       (unused)
  dpo         the implicit reward's scale                    sigmoid, ipo, hinge or robust (auto: sigmoid)
  simpo       the length-normalised reward's scale           (unused: sigmoid, with simpo_gamma's margin)
  orpo        the odds-ratio term's weight                   (unused)
  grpo        the KL coefficient (0 = none)                  grpo, dr_grpo or dapo (auto: dapo)

The keys only one objective reads are its own module's: preference.py (dpo, simpo, orpo), grpo.py; which keys each
objective owns, and what the layers below the trainer know of it, traits.py's registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import Bound, key
from hybridtune.config.preference import trl_range
from hybridtune.config.traits import known_objective, objective_names, unknown_objective


@dataclass
class ObjectiveKeys:
    objective: str = key(  # one of traits.py's registry (the built-ins, and any registered objective)
        "sft",
        "what training minimises: sft = next-token cross-entropy on the trained tokens; dpo, simpo, orpo = "
        "preference tuning on prompt/chosen/rejected pairs; grpo = RL on rewarded samples",
        Bound(lambda v, cfg: known_objective(v), lambda cfg: unknown_objective(cfg.objective)),
        shown=lambda: " | ".join(repr(name) for name in objective_names()),  # (--help: the registry's names)
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
