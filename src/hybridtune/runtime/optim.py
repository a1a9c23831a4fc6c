"""The optimizer and the learning-rate schedule of a run (warmup given in steps or as a share of the run)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from hybridtune.config import TrainConfig

logger = logging.getLogger(__name__)


def lr_lambda(kind: str, warmup: int, total: int) -> Callable[[int], float]:
    """The learning-rate multiplier of step `step`: linear warmup, then constant, linear or cosine decay to 0.

    >>> f = lr_lambda("linear", 2, 10)
    >>> [round(f(s), 3) for s in (0, 1, 2, 6, 10)]
    [0.5, 1.0, 1.0, 0.5, 0.0]
    """

    def f(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (the fused kernel on a GPU)."""
    fused = device.type == "cuda"
    return torch.optim.AdamW(params, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, fused=fused)


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The run's warmup in steps: `warmup_ratio` of `total_steps` rounded up (as transformers rounds it) when set,
    else `warmup_steps`."""
    if cfg.warmup_ratio > 0:
        return math.ceil(cfg.warmup_ratio * total_steps)
    return cfg.warmup_steps


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    warmup = warmup_steps(cfg, total_steps)
    if cfg.warmup_ratio > 0:
        logger.info("warmup: %d of %d steps (warmup_ratio %g)", warmup, total_steps, cfg.warmup_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_scheduler, warmup, total_steps))
