"""What a training run returns to its caller (`train.trainer.train`, the `train` command, tests)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TrainResult:
    steps: int
    losses: list[float] = field(default_factory=list)  # loss of every optimizer step run in this process
    evals: list[dict] = field(default_factory=list)
    output_dir: str = ""
    final_dir: str | None = None
    interrupted: bool = False
    signal: str | None = None  # the signal that stopped it (SIGINT, SIGTERM), when one did
