"""The optimizer and the learning-rate schedule of a run."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from hybridtune.config import TrainConfig


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


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg.lr_scheduler, cfg.warmup_steps, total_steps))
