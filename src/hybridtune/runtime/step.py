"""The loss of one packed micro-batch, shared by the trainer and the benchmark.

Two paths, the same number:

- `fused=False`: `model(**batch, labels=...)`, transformers' own loss over `[T, vocab]` logits.
- `fused=True`: the decoder stack's hidden states and `lm_head`'s weight go to
  `hybridtune.ops.loss.linear_cross_entropy`, which works through the tokens in chunks and never keeps
  the `[T, vocab]` logits (with Qwen3.5's 248k vocabulary they are 2 GiB in bf16 per 4096 tokens, 4 GiB
  again for their fp32 upcast). Used when the model's head is a plain Linear and the loss is plain
  next-token cross-entropy (no logit soft-capping); an MoE router loss is added as the model's forward adds it.

An MoE model's router (load-balancing) loss, `coef * load_balancing_loss_func(router_logits, ...)` as its
forward computes it, counts only the bin's own tokens: a static layout's filler documents (the batch's last
`T - num_tokens` tokens) are masked out of its statistics (`real_token_mask`). Without filler the unfused path
is exactly the model's own forward.

Both return the sum of per-token losses over the batch divided by `num_items`, the number of trained
tokens in the whole accumulation window, so k micro-batches accumulate to one k times as large.
"""

from __future__ import annotations

import torch

from hybridtune.batch import GDN_CHUNK_INDICES, INPUT_IDS, LABELS, MODEL_KEYS, NUM_TOKENS
from hybridtune.data import IGNORE_INDEX
from hybridtune.models.anatomy import output_head, router_loss, router_loss_terms, text_config, text_model, unwrap
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
    if router_loss(base) and router_loss_terms(base) is None:
        return "the model adds a router loss whose terms hybridtune cannot find"
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


def real_token_mask(batch: dict) -> torch.Tensor | None:
    """float [1, T]: 1 at the bin's own tokens, 0 at a static layout's filler (its last `T - num_tokens` tokens);
    None when the batch has no filler."""
    ids = batch[INPUT_IDS]
    T, n = ids.shape[-1], batch.get(NUM_TOKENS)
    if n is None or n >= T:
        return None
    return (torch.arange(T, device=ids.device) < n).to(torch.float32)[None]


def forward_loss(model: torch.nn.Module, batch: dict, num_items: int, fused: bool) -> torch.Tensor:
    """Loss of one micro-batch (sum over its trained tokens / `num_items`); see the module docstring."""
    kwargs = model_inputs(batch)
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
