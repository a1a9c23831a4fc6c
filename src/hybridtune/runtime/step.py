"""The model's side of a packed micro-batch, shared by every objective, the trainer and the benchmark.

`model_inputs` (the batch's keyword arguments for the model), `shifted_targets` (next-token labels `[T]` of a
`[1, T]` row), `real_token_mask` (`[1, T]`: 1 at the bin's own tokens, 0 at a static layout's filler) and
`fused_loss_blocker` (why the chunked loss cannot stand in for a model's own). The losses are the objectives'
(`train/objectives/`).
"""

from __future__ import annotations

import torch

from hybridtune.batch import INPUT_IDS, LABELS, MODEL_KEYS, MROPE_POSITION_IDS, NUM_TOKENS, POSITION_IDS
from hybridtune.data import IGNORE_INDEX
from hybridtune.mixers import registry
from hybridtune.models.anatomy import output_head, router_loss, router_loss_terms, text_config, unwrap
from hybridtune.runtime.vision import image_embeds


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


def model_inputs(batch: dict, labels: bool = True, model: torch.nn.Module | None = None) -> dict:
    """The batch's keyword arguments for the model (with or without `labels`), training and eval alike.

    A pack with images (a vision-language model's) passes its 3-D M-RoPE positions as transformers' four-row
    `position_ids` [4, 1, T] (the text row, then temporal, height, width), and its `pixel_values` and
    `image_grid_thw`; given the `model`, these become `inputs_embeds` (runtime/vision.py's `image_embeds`: the
    vision tower run apart from the text's packing keywords).

    A mixer's metadata size (a chunk count) differs from batch to batch in every pack layout: its tensors
    (`registry.dynamic_keys`) are marked maybe-dynamic, so a compiled frame that receives them (the per-class forwards of `compile: modules`) takes it as a symbol
    from the first call instead of compiling again for the second count. (The loop's wrapper marks it itself;
    eager ignores the mark.)
    """
    kwargs = {k: batch[k] for k in registry.model_keys(MODEL_KEYS) if k in batch and (labels or k != LABELS)}
    if batch.get(MROPE_POSITION_IDS) is not None:
        kwargs[POSITION_IDS] = torch.cat([batch[POSITION_IDS][None], batch[MROPE_POSITION_IDS][:, None]], 0)
    for key in registry.dynamic_keys():
        if isinstance(kwargs.get(key), torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(kwargs[key], 0)
    return image_embeds(model, kwargs) if model is not None else kwargs


def real_token_mask(batch: dict) -> torch.Tensor | None:
    """float [1, T]: 1 at the bin's own tokens, 0 at a static layout's filler (its last `T - num_tokens` tokens);
    None when the batch has no filler."""
    ids = batch[INPUT_IDS]
    T, n = ids.shape[-1], batch.get(NUM_TOKENS)
    if n is None or n >= T:
        return None
    return (torch.arange(T, device=ids.device) < n).to(torch.float32)[None]
