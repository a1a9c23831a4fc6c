"""The loss of one packed micro-batch, shared by the trainer and the benchmark.

Two paths, the same number:

- `fused=False`: `model(**batch, labels=...)`, transformers' own loss over `[T, vocab]` logits.
- `fused=True`: the decoder stack's hidden states and `lm_head`'s weight go to
  `hybridtune.ops.loss.linear_cross_entropy`, which works through the tokens in chunks and never keeps
  the `[T, vocab]` logits (with Qwen3.5's 248k vocabulary they are 2 GiB in bf16 per 4096 tokens, 4 GiB
  again for their fp32 upcast). Used when the model's head is a plain Linear and the loss is plain
  next-token cross-entropy (no logit soft-capping, no extra loss terms such as an MoE router loss).

Both return the sum of per-token losses over the batch divided by `num_items`, the number of trained
tokens in the whole accumulation window, so k micro-batches accumulate to one k times as large.
"""

from __future__ import annotations

import torch

from hybridtune.batch import GDN_CHUNK_INDICES, LABELS, MODEL_KEYS
from hybridtune.data import IGNORE_INDEX
from hybridtune.models.anatomy import output_head, router_loss, text_config, text_model, unwrap
from hybridtune.ops.loss import linear_cross_entropy


def fused_loss_blocker(model: torch.nn.Module) -> str | None:
    """Why the fused loss cannot stand in for this model's own loss, or None when it can."""
    base = unwrap(model)
    text_cfg = text_config(base)
    head = output_head(base)
    if not isinstance(head, torch.nn.Linear) or type(head) is not torch.nn.Linear:
        return f"the output head is {type(head).__name__}, not a plain Linear"
    if head.bias is not None:
        return "the output head has a bias"
    if getattr(text_cfg, "final_logit_softcapping", None):
        return "the model soft-caps its logits"
    if router_loss(base):
        return "the model adds a router loss"
    return None


def shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Next-token targets for a `[1, T]` label row: position t predicts label t+1; the last predicts nothing."""
    flat = labels.reshape(-1)
    return torch.cat([flat[1:], flat.new_full((1,), IGNORE_INDEX)])


def model_inputs(batch: dict, labels: bool = True) -> dict:
    """The batch's keyword arguments for the model (with or without `labels`), training and eval alike.

    The GDN chunk count differs from batch to batch in every pack layout: its tensor is marked maybe-dynamic,
    so a compiled frame that receives it (the per-class forwards of `compile: modules`) takes it as a symbol
    from the first call instead of compiling again for the second count. (The loop's wrapper marks it itself;
    eager ignores the mark.)
    """
    kwargs = {k: batch[k] for k in MODEL_KEYS if k in batch and (labels or k != LABELS)}
    if isinstance(kwargs.get(GDN_CHUNK_INDICES), torch.Tensor):
        torch._dynamo.maybe_mark_dynamic(kwargs[GDN_CHUNK_INDICES], 0)
    return kwargs


def forward_loss(model: torch.nn.Module, batch: dict, num_items: int, fused: bool) -> torch.Tensor:
    """Loss of one micro-batch (sum over its trained tokens / `num_items`); see the module docstring."""
    kwargs = model_inputs(batch)
    if not fused:
        return model(**kwargs, num_items_in_batch=max(num_items, 1)).loss
    base = unwrap(model)
    labels = kwargs.pop(LABELS)
    hidden = text_model(base)(**kwargs, use_cache=False).last_hidden_state
    head = output_head(base)
    total = linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), head.weight, shifted_targets(labels), ignore_index=IGNORE_INDEX
    )
    return total / max(num_items, 1)
