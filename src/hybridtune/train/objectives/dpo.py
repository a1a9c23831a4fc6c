"""Preference tuning: `objective: dpo` (with `loss_type` sigmoid, ipo, hinge or robust), `simpo` and `orpo`, as TRL
defines them, on packs of whole pairs (preference.py, data/pairs.py).

With z = beta * ((chosen - rejected) - (ref_chosen - ref_rejected)) over the replies' summed log-probabilities
(length-averaged for ipo), per pair and label smoothing e:
    sigmoid  -(1 - e) log s(z) - e log s(-z)            hinge  max(0, 1 - z)
    robust   (-(1 - e) log s(z) + e log s(-z)) / (1 - 2e)     ipo   (z / beta - 1 / (2 beta))^2
simpo (reference-free, length-averaged): sigmoid's with z = beta * (chosen - rejected) - simpo_gamma;
orpo (reference-free, length-averaged): NLL(chosen) - beta * log s(log odds(chosen) - log odds(rejected)).
Rewards are beta * (logp - ref_logp) for dpo, beta * logp for simpo and orpo. `rpo_alpha` adds rpo_alpha x the
NLL of the chosen replies (TRL's rpo_alpha; for simpo its cpo_alpha), averaged over their trained tokens.

The window's loss is the mean over its pairs (the NLL term: over its chosen tokens), so micro-batches add up to it;
the metrics of a step go to its log line and metrics.jsonl as TRL names them (rewards/chosen, ...).
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F

from hybridtune.batch import LABELS, NUM_PAIRS, PAIR_INDEX, PAIR_SIDE
from hybridtune.config import TrainConfig
from hybridtune.runtime import distributed, lora
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.train.objectives.preference import (
    WINDOW_CHOSEN_TOKENS,
    WindowMetrics,
    chosen_tokens,
    frozen_copy,
    pair_logps,
    reference_logps,
)
from hybridtune.train.objectives.spec import check_keys

logger = logging.getLogger(__name__)

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")
AVERAGED = ("ipo",)  # dpo loss types on length-averaged log-probabilities (simpo and orpo always are)


def dpo_losses(z: torch.Tensor, beta: float, loss_type: str, smoothing: float) -> torch.Tensor:
    """Per-pair DPO losses from z = beta * (policy log-ratio - reference log-ratio)."""
    if loss_type == "sigmoid":
        return -(1 - smoothing) * F.logsigmoid(z) - smoothing * F.logsigmoid(-z)
    if loss_type == "robust":
        return (-(1 - smoothing) * F.logsigmoid(z) + smoothing * F.logsigmoid(-z)) / (1 - 2 * smoothing)
    if loss_type == "hinge":
        return torch.relu(1 - z)
    if loss_type == "ipo":
        return (z / beta - 1 / (2 * beta)) ** 2
    raise ValueError(f"unknown dpo loss_type {loss_type!r}")


def log_odds(logp: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) of a length-averaged log-probability."""
    return logp - torch.log1p(-torch.exp(logp))


@dataclasses.dataclass
class Preference:
    """`objective: dpo | simpo | orpo`; `fused`: log-probabilities from the chunked head (train's `loss` choice)."""

    name: str = "dpo"
    fused: bool = True
    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0
    rpo_alpha: float | None = None
    simpo_gamma: float = 0.5
    reference: torch.nn.Module | None = None  # a full fine-tune's frozen starting model; None: adapters switched off
    batch_keys: frozenset[str] = frozenset({LABELS, PAIR_INDEX, PAIR_SIDE, NUM_PAIRS})
    needs_generation: bool = False
    metrics: WindowMetrics = dataclasses.field(default_factory=WindowMetrics)

    @property
    def needs_reference(self) -> bool:
        return self.name == "dpo"

    @property
    def nll_weight(self) -> float:
        return 1.0 if self.name == "orpo" else (self.rpo_alpha or 0.0)

    @property
    def averaged(self) -> bool:
        return self.name in ("simpo", "orpo") or self.loss_type in AVERAGED

    def window_items(self, batches: list[dict]) -> int:
        """The window's pairs (what its loss is averaged over); marks every micro-batch with the window's chosen
        tokens when an NLL term needs them. Starts the window's metrics."""
        self.metrics.reset()
        if self.nll_weight:
            tokens = sum(chosen_tokens(b) for b in batches)
            for b in batches:
                b[WINDOW_CHOSEN_TOKENS] = tokens
        return sum(b[NUM_PAIRS] for b in batches)

    def step_metrics(self, d: distributed.Dist = distributed.ONE) -> dict[str, float]:
        """The step's metrics (means over its pairs on every rank); a collective under torchrun."""
        return self.metrics.take(d)

    def loss(self, model: torch.nn.Module, batch: dict, num_items: int) -> torch.Tensor:
        ref = reference_logps(model, self.reference, batch, self.fused) if self.needs_reference else None
        logps, tokens = pair_logps(model, batch, self.fused)
        nll_sum = -logps[:, 0].sum()
        if self.averaged:
            logps = logps / tokens.clamp(min=1)
            ref = ref[0] / tokens.clamp(min=1) if ref is not None else None
        elif ref is not None:
            ref = ref[0]
        chosen, rejected = logps[:, 0], logps[:, 1]
        extra: dict[str, torch.Tensor] = {}
        if self.name == "dpo":
            rewards = self.beta * (logps - ref).detach()
            z = self.beta * ((chosen - rejected) - (ref[:, 0] - ref[:, 1]))
            losses = dpo_losses(z, self.beta, self.loss_type, self.label_smoothing)
        elif self.name == "simpo":
            rewards = self.beta * logps.detach()
            z = self.beta * (chosen - rejected) - self.simpo_gamma
            losses = dpo_losses(z, self.beta, "sigmoid", self.label_smoothing)
        else:  # orpo
            rewards = self.beta * logps.detach()
            odds = log_odds(chosen) - log_odds(rejected)
            ratio = F.logsigmoid(odds)
            losses = -self.beta * ratio
            extra = {"log_odds_ratio": ratio.detach(), "log_odds_chosen": odds.detach()}
        total = losses.sum() / max(num_items, 1)
        if self.nll_weight:
            total = total + self.nll_weight * nll_sum / max(batch[WINDOW_CHOSEN_TOKENS], 1)
            extra |= {"nll_loss": nll_sum.detach(), "nll_tokens": tokens[:, 0].sum()}
        self.metrics.add(
            {
                "rewards/chosen": rewards[:, 0],
                "rewards/rejected": rewards[:, 1],
                "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).to(rewards.dtype),
                "rewards/margins": rewards[:, 0] - rewards[:, 1],
                "logps/chosen": chosen.detach(),
                "logps/rejected": rejected.detach(),
                "pairs": chosen.new_tensor(float(chosen.shape[0])),
                **extra,
            }
        )
        return total


def build_preference(cfg: TrainConfig, fused: bool, model: torch.nn.Module | None = None) -> Preference:
    """The objective of `cfg`; `model` (the freshly built one) gives a full fine-tune's dpo its frozen reference."""
    check_keys(cfg)
    reference = None
    if cfg.objective == "dpo" and adapter_kind(cfg).lora:
        logger.info(
            "reference model: the policy with its LoRA adapters switched off as data (each layer's scale 0: the "
            "policy's compiled code, one more forward, detached)"
        )
        if model is not None:
            lora.live_scales(model)  # the scales are tensors from the first forward on (eval's too): no recompile
    elif cfg.objective == "dpo" and model is not None:
        reference = frozen_copy(model)
    return Preference(
        name=cfg.objective, fused=fused, beta=cfg.beta, label_smoothing=cfg.label_smoothing,
        loss_type=DPO_LOSS_TYPES[0] if cfg.loss_type == "auto" else cfg.loss_type,
        rpo_alpha=cfg.rpo_alpha, simpo_gamma=cfg.simpo_gamma, reference=reference,
    )  # fmt: skip
