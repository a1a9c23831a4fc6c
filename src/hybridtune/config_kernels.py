"""The kernel-backend keys of a run (a leaf: `config_schema.TrainConfig` inherits them; kernels/provision.py applies
them before the modeling import, through the GatedDeltaNet mixer's `backend.pin`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass
class KernelKeys:
    gdn_backend: Literal["auto", "fla-triton", "flash-qla"] = field(
        default="auto",
        metadata={
            "help": "GatedDeltaNet chunk kernels: auto = what FLA dispatches to (FlashQLA if installed and accepted), "
            "else fla-triton or flash-qla pinned; each runs once the device self-test passes it"
        },
    )
