"""Qwen3.5 adapter (dense, MoE, and the text path of ForConditionalGeneration): the input projection of its
GatedDeltaNet mixer; the core after it is `core.py`'s, shared with Qwen3-Next.

A mixer is recognised by its structure (the projections and parameters it owns), never by its name.
"""

from __future__ import annotations

import torch

from hybridtune.mixers.gdn.core import CORE_ATTRS

PROJ_ATTRS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
NAME = "qwen3_5-gdn"


def matches(module: torch.nn.Module) -> bool:
    """True for a Qwen3.5-layout GDN mixer: separate q/k/v, z, b and a input projections."""
    return all(hasattr(module, a) for a in PROJ_ATTRS) and all(hasattr(module, a) for a in CORE_ATTRS)


def project(module, hidden_states: torch.Tensor):
    """hidden [B, T, hidden] -> (mixed_qkv [B, T, 2*key_dim + value_dim], z [B, T, HV, V], b, a [B, T, HV])."""
    B, T, _ = hidden_states.shape
    mixed_qkv = module.in_proj_qkv(hidden_states)
    z = module.in_proj_z(hidden_states).reshape(B, T, -1, module.head_v_dim)
    return mixed_qkv, z, module.in_proj_b(hidden_states), module.in_proj_a(hidden_states)
