"""Qwen3-Next adapter: its GatedDeltaNet mixer (fused qkvz and ba projections, head-grouped layout)
on hybridtune ops. Recognised by structure; the core after the projection is `core.py`'s."""

from __future__ import annotations

import torch

from hybridtune.mixers.gdn.core import CORE_ATTRS

PROJ_ATTRS = ("in_proj_qkvz", "in_proj_ba", "fix_query_key_value_ordering")
NAME = "qwen3_next-gdn"


def matches(module: torch.nn.Module) -> bool:
    """True for a Qwen3-Next-layout GDN mixer: fused qkvz / ba projections grouped by key head."""
    return all(hasattr(module, a) for a in PROJ_ATTRS) and all(hasattr(module, a) for a in CORE_ATTRS)


def project(module, hidden_states: torch.Tensor):
    """hidden [B, T, hidden] -> (mixed_qkv [B, T, 2*key_dim + value_dim], z [B, T, HV, V], b, a [B, T, HV]).

    Uses the module's own `fix_query_key_value_ordering`, so the head grouping is upstream's."""
    B, T, _ = hidden_states.shape
    q, k, v, z, b, a = module.fix_query_key_value_ordering(
        module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states)
    )
    mixed_qkv = torch.cat([t.reshape(B, T, -1) for t in (q, k, v)], dim=-1)
    return mixed_qkv, z, b, a
