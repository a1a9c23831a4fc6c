"""Supervised fine-tuning: next-token cross-entropy over a packed micro-batch's trained tokens.

Two paths, the same number: `fused=False` is `model(**batch, labels=...)`, transformers' own loss over `[T, vocab]`
logits; `fused=True` sends the decoder stack's hidden states `[T, hidden]` and `lm_head.weight` `[vocab, hidden]` to
`ops.loss.linear_cross_entropy`, which works through the tokens in chunks and never keeps `[T, vocab]` logits. An MoE
router loss is added as the model's forward adds it, over the bin's own tokens only (a static layout's filler is
masked out). The result is the sum of per-token losses divided by `num_items`, the trained tokens of the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridtune.batch import LABELS, NUM_LOSS_TOKENS
from hybridtune.data import IGNORE_INDEX
from hybridtune.models.anatomy import output_head, router_loss_terms, text_config, text_model, unwrap
from hybridtune.ops.loss import linear_cross_entropy
from hybridtune.runtime.step import model_inputs, real_token_mask, shifted_targets


def sft_loss(model: torch.nn.Module, batch: dict, num_items: int, fused: bool) -> torch.Tensor:
    """Loss of one micro-batch (sum over its trained tokens / `num_items`); see the module doc."""
    kwargs = model_inputs(batch, model=model)
    terms = router_loss_terms(model)
    mask = real_token_mask(batch) if terms is not None else None
    if not fused and mask is None:
        return model(**kwargs, num_items_in_batch=max(num_items, 1)).loss  # the model's own, router term included
    base = unwrap(model)
    labels = kwargs.pop(LABELS)
    if fused:
        extra = {"output_router_logits": True} if terms is not None else {}
        out = text_model(base)(**kwargs, use_cache=False, **extra)
        hidden = out.last_hidden_state
        head = output_head(base)
        total = linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted_targets(labels), ignore_index=IGNORE_INDEX
        )
        total = total / max(num_items, 1)
    else:  # the model's logits and cross-entropy; its router term over every token (filler too) is not used
        out = model(**kwargs)
        vocab = text_config(base).vocab_size
        total = base.loss_function(out.logits, labels, vocab, num_items_in_batch=max(num_items, 1))
    if terms is not None:
        aux = terms.fn(out.router_logits, terms.num_experts, terms.top_k, mask)
        total = total + terms.coef * aux.to(total.device)
    return total


@dataclass(frozen=True)
class SFT:
    """`objective: sft`. `fused`: the chunked loss (train's `loss` choice, `runtime.choices`)."""

    fused: bool = True
    name: str = "sft"
    batch_keys: frozenset[str] = frozenset({LABELS})
    needs_reference: bool = False
    needs_generation: bool = False

    def window_items(self, batches: list[dict]) -> int:
        return sum(b[NUM_LOSS_TOKENS] for b in batches)  # the window's trained tokens

    def loss(self, model: torch.nn.Module, batch: dict, num_items: int) -> torch.Tensor:
        return sft_loss(model, batch, num_items, self.fused)

    def step_metrics(self, d=None) -> dict[str, float]:
        return {}
