"""Where things sit inside a transformers model (plain, peft-wrapped, or vision-language): one place for the
questions every layer asks of a model. A leaf module: it imports nothing of ours, so any layer may use it, and
not torch at import time (the kernel resolver reads configs with it before torch is loaded).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

# The attribute under which a patched module keeps its original forward (models.patching writes it, the module
# compiler and the kernel report read it).
PATCHED_FORWARD_ATTR = "_hybridtune_original_forward"


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def text_config(obj):
    """The text part of a model's or a config's configuration (a vision-language config's `text_config`), or the
    configuration itself; None for a model without a config."""
    if hasattr(obj, "named_modules"):  # a model (torch.nn.Module): its config
        obj = getattr(unwrap(obj), "config", None)
    get = getattr(obj, "get_text_config", None)
    return get() if callable(get) else obj


def text_model(model: torch.nn.Module) -> torch.nn.Module:
    """The outermost module owning `embed_tokens` and a `layers` ModuleList: the decoder stack (of a causal LM, a
    vision-language model's language part, peft-wrapped or not)."""
    import torch  # here, not at the top: see the module docstring

    for _, m in model.named_modules():
        if hasattr(m, "embed_tokens") and isinstance(getattr(m, "layers", None), torch.nn.ModuleList):
            return m
    raise ValueError(
        f"no decoder stack (a module with `embed_tokens` and a `layers` ModuleList) in {type(model).__name__}"
    )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers, in order."""
    return list(text_model(model).layers)


def output_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The language-model head (`lm_head`), or None when the model has none."""
    base = unwrap(model)
    get = getattr(base, "get_output_embeddings", None)
    return get() if callable(get) else None


def router_loss(model: torch.nn.Module) -> bool:
    """Whether the model's own loss adds an MoE router (load-balancing) loss: it then records every router's
    logits during the forward (transformers' `output_router_logits`)."""
    return bool(getattr(text_config(model), "output_router_logits", False))


class RouterLoss(NamedTuple):
    """What an MoE model's own forward adds to its loss: `coef * fn(router_logits, num_experts, top_k, mask)`, `fn`
    being the `load_balancing_loss_func` of the model's modeling module (mask: [1, T] of the tokens that count)."""

    fn: Any
    num_experts: int
    top_k: int
    coef: float


def router_loss_terms(model: torch.nn.Module) -> RouterLoss | None:
    """The router (load-balancing) loss term the model's forward adds, as its modeling module computes it; None
    when the model adds none, or its module has no `load_balancing_loss_func` or its config lacks the sizes."""
    if not router_loss(model):
        return None
    base = unwrap(model)
    cfg = text_config(base)
    fn = getattr(sys.modules.get(type(base).__module__), "load_balancing_loss_func", None)
    sizes = [getattr(cfg, k, None) for k in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")]
    if not callable(fn) or any(v is None for v in sizes):
        return None
    return RouterLoss(fn, int(sizes[0]), int(sizes[1]), float(sizes[2]))


def param_count(model: torch.nn.Module) -> int:
    """Parameters held by the model (tied weights once)."""
    return sum(p.numel() for p in model.parameters())
