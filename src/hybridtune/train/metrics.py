"""Per-step metrics: throughput, memory, and the metrics.jsonl log."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from hybridtune.train.checkpoint import atomic_write_text


def memory_gib(device: torch.device) -> float:
    """Peak allocated GiB on a CUDA device since the last reset; resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    try:
        import resource

        # ru_maxrss is KiB on Linux.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except ImportError:  # not on Linux/macOS
        return float("nan")


class Throughput:
    """Tokens per second over the window since the last `take()`."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, n: int) -> None:
        self.tokens += n

    def skip(self, seconds: float) -> None:
        """Leave `seconds` (spent on something other than training, e.g. summarising a profile) out of the window."""
        self.t0 += seconds

    def take(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.t0, 1e-9)
        self.t0, self.tokens = now, 0
        return rate


class MetricsLog:
    """Appends one JSON object per line; each record is flushed so a crash loses nothing logged."""

    def __init__(self, path: Path, truncate: bool, after_step: int | None = None) -> None:
        """`truncate`: start an empty file. `after_step`: a resumed run's step; rows an earlier process logged past
        it (and a line a kill left torn) are dropped, since the resumed run logs those steps again."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not truncate and after_step is not None and self.path.is_file():
            kept = []
            for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # torn by a kill mid-write
                if isinstance(row, dict) and row.get("step", 0) <= after_step:
                    kept.append(line + "\n")
            atomic_write_text(self.path, "".join(kept))
        self.f = self.path.open("w" if truncate else "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self.f.write(json.dumps(record) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def format_step(rec: dict) -> str:
    """The one log line per step: `step loss grad_norm lr tok/s mem` (`mem`: the peak over ranks under torchrun)."""
    return (
        f"step {rec['step']:>5}  loss {rec['loss']:.4f}  grad_norm {rec['grad_norm']:.3f}  "
        f"lr {rec['lr']:.2e}  tok/s {rec['tokens_per_s']:,.0f}  mem {rec['mem_gib']:.2f} GiB"
    )
