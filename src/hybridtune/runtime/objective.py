"""The objective seam: what a training objective gives the runtime, and what it asks of it.

The engine (`runtime.distributed.LossModule`, wrapped by DDP/FSDP2, compiled by the loop) calls
`objective.loss(model, batch, num_items)` for every micro-batch and backpropagates what it returns: the sum of the
micro-batch's per-item losses divided by `num_items`, the count over the whole accumulation window, so the
micro-batches of a window add up to its mean. Objectives live in `train/objectives/` (`sft.py`, `dpo.py`, `grpo.py`),
each with its spec there (`spec.ObjectiveSpec`: its data, collator, rollouts); the runtime names none of them.
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

    def window_items(self, batches: list[dict]) -> int:
        """`num_items` of a window: what its loss is averaged over (trained tokens, pairs), from every micro-batch
        of the window (collated, on the host; each rank sees them all). May mark the batches with window totals."""
        ...

    def loss(self, model: torch.nn.Module, batch: dict, num_items: int) -> torch.Tensor:
        """A 0-d tensor: this micro-batch's summed loss over `num_items` (see the module doc)."""
        ...

    def step_metrics(self, d) -> dict[str, float]:
        """The objective's own metrics of the step just run (`{}` for none), for its log line and metrics.jsonl;
        called once a step on every rank after the backward (`d`: the run's `runtime.distributed.Dist`)."""
        ...
