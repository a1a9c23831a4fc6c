"""The kernel keys of a run: the GatedDeltaNet chunk kernels' backend (`gdn_backend`: kernels/provision.py applies it
before the modeling import, through the GatedDeltaNet mixer's `backend.pin`) and the cross-entropy's (`loss`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import key


@dataclass
class KernelKeys:
    gdn_backend: Literal["auto", "fla-triton", "flash-qla"] = key(
        "auto",
        "GatedDeltaNet chunk kernels: auto = what FLA dispatches to (FlashQLA if installed and accepted), "
        "else fla-triton or flash-qla pinned; each runs once the device self-test passes it",
    )


@dataclass
class LossKeys:
    loss: Literal["auto", "fused", "plain"] = key(
        "auto",
        "cross-entropy: fused = chunked against lm_head without [tokens, vocab] logits, plain = transformers' own, "
        "auto = fused where the model's head allows it",
    )
