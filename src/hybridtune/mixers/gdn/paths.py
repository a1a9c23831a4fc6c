"""Where a routed GatedDeltaNet module's work runs, for the kernel path report (kernels/paths.py)."""

from __future__ import annotations

from typing import Any

import torch

from hybridtune.mixers.gdn import backend as chunk_backend
from hybridtune.mixers.gdn import fla_guard
from hybridtune.mixers.gdn import ops as gdn


def op_path(module: Any) -> tuple[str, bool]:
    """(description, fast) of hybridtune's op backend for the device the mixer's weights are on."""
    try:
        device = next(module.parameters()).device
    except StopIteration:
        device = None
    if device is None or device.type == "meta":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name, why = gdn.backend(device)
    if name != "fla":
        return f"torch reference ({why})", False
    key = tuple(int(getattr(module, a, 0)) for a in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim"))
    chunk = chunk_backend.for_op(key)  # FLA's own dispatch decision, FlashQLA only once the self-test granted it
    if chunk.name == chunk_backend.FLASH_QLA:
        return f"fla ({why}); GDN chunk: {chunk.label}", True
    note = f" ({chunk.why})" if "flash-qla" in chunk.why else ""
    if fla_guard.guard_active() and not fla_guard.is_granted(key):
        return f"fla forward; backward refused by FLA's Hopper guard until the self-test grants {key}{note}", False
    return f"fla ({why}); GDN chunk: {chunk.label}{note}", True
