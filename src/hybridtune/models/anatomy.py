"""Where things sit inside a transformers model (plain, peft-wrapped, or vision-language): one place for the
questions every layer asks of a model. A leaf module: it imports nothing of ours, so any layer may use it, and
not torch at import time (the kernel resolver reads configs with it before torch is loaded).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def param_count(model: torch.nn.Module) -> int:
    """Parameters held by the model (tied weights once)."""
    return sum(p.numel() for p in model.parameters())
