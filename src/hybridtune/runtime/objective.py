"""The objective seam: what a training objective gives the runtime, and what it asks of it.

The engine (`runtime.distributed.LossModule`, wrapped by DDP/FSDP2, compiled by the loop) calls
`objective.loss(model, batch, num_items)` for every micro-batch and backpropagates what it returns: the sum of the
micro-batch's per-item losses divided by `num_items`, the count over the whole accumulation window, so the
micro-batches of a window add up to its mean. Objectives live in `train/objectives/` (`sft.py` today); the runtime
names none of them.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class Objective(Protocol):
    name: str  # the config's `objective` value
    batch_keys: frozenset[str]  # batch fields it reads beyond the model's inputs (a collator must provide them)
    needs_reference: bool  # reads a frozen reference model's outputs (preference tuning, a KL term)
    needs_generation: bool  # samples completions from the policy before its step (on-policy objectives)

    def loss(self, model: torch.nn.Module, batch: dict, num_items: int) -> torch.Tensor:
        """A 0-d tensor: this micro-batch's summed loss over `num_items` (see the module doc)."""
        ...
