"""The run's curves as PNG files in its output directory, drawn from its metrics.jsonl at each save and at the end.

- `loss.png`: the logged training loss (each logged step's `loss`, the mean since the line before) and, where the
  run holds data out, the eval loss at each eval.
- `reward.png` (grpo): the mean reward of each logged step's completions and, with several reward functions, each
  function's mean (`rewards/<name>/mean`): the trend that matters there, since grpo's loss stays near zero.
- `reward_accuracy.png` (dpo, simpo, orpo): `rewards/accuracies`, the share of pairs whose chosen reply scores above
  the rejected one, and `rewards/margins`.

Drawn with matplotlib's Agg canvas (no display, no pyplot state shared with the caller), each file written whole
through `files.atomic_write_bytes` (a reader never sees half a PNG; a link at the name is replaced, not followed).
Drawing is never worth a run: a failure is one warning line (once per output directory), and training goes on.
"""

from __future__ import annotations

import io
import json
import logging
import math
from pathlib import Path

from hybridtune.files import atomic_write_bytes, open_regular

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT, REWARD_PLOT, ACCURACY_PLOT = "loss.png", "reward.png", "reward_accuracy.png"
PLOT_FILES = (LOSS_PLOT, REWARD_PLOT, ACCURACY_PLOT)  # what a run may write beside metrics.jsonl (outdir: its own)
_warned: set[str] = set()  # output directories whose plot failure was said (once each)


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl (a regular file only); a torn or foreign line is skipped."""
    with open_regular(path) as f:
        text = f.read().decode("utf-8", errors="replace")
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # (nested past the recursion limit: not a record either)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows


def series(rows: list[dict], kind: str, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of `key` in the records of type `kind`, finite numbers only.

    >>> series([{"type": "train", "step": 1, "loss": 2.0}, {"type": "eval", "step": 1, "loss": 9.0},
    ...         {"type": "train", "step": 2, "loss": float("nan")}, {"type": "train", "step": 3, "loss": 1.5}],
    ...        "train", "loss")
    ([1, 3], [2.0, 1.5])
    """
    steps, values = [], []
    for row in rows:
        v = row.get(key)
        if row.get("type", "train") == kind and isinstance(v, (int, float)) and not isinstance(v, bool):
            if math.isfinite(v):
                steps.append(row["step"])
                values.append(float(v))
    return steps, values


def curves(rows: list[dict]) -> dict[str, tuple[str, list[tuple[str, list[int], list[float]]]]]:
    """What to draw: file name -> (y label, [(legend, steps, values), ...]), only the files that have a curve."""
    keys = {k for r in rows if r.get("type", "train") == "train" for k in r}
    names = sorted(
        k.split("/")[1] for k in keys if k.startswith("rewards/") and k.endswith("/mean") and k.count("/") == 2
    )
    wanted = {
        LOSS_PLOT: ("loss", [("train loss", "train", "loss"), ("eval loss", "eval", "eval_loss")]),
        REWARD_PLOT: (
            "reward",
            [("mean reward", "train", "reward")]
            + ([(n, "train", f"rewards/{n}/mean") for n in names] if len(names) > 1 else []),
        ),
        ACCURACY_PLOT: (
            "rewards/accuracies",
            [("rewards/accuracies", "train", "rewards/accuracies"), ("rewards/margins", "train", "rewards/margins")],
        ),
    }
    out = {}
    for file, (label, specs) in wanted.items():
        lines = [(legend, *series(rows, kind, key)) for legend, kind, key in specs]
        lines = [line for line in lines if line[1]]
        if lines and lines[0][0] == specs[0][0]:  # drawn where its main curve (the first) has a point
            out[file] = (label, lines)
    return out


def draw(title: str, label: str, lines: list[tuple[str, list[int], list[float]]]) -> bytes:
    """One PNG: each line against the optimizer step (a single point as a marker), a legend when there are two."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for legend, steps, values in lines:
        marker = "o" if len(steps) < 30 else None
        ax.plot(steps, values, label=legend, marker=marker, markersize=3, linewidth=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if len(lines) > 1:
        ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def plot_run(output_dir: str | Path) -> list[Path]:
    """Write the run's curves (see the module docstring) into `output_dir` from its metrics.jsonl; returns the files
    written (none before a step is logged). Never raises: a failure is one warning line."""
    out = Path(output_dir)
    try:
        written = []
        for file, (label, lines) in curves(read_metrics(out / METRICS_FILE)).items():
            atomic_write_bytes(out / file, draw(f"{out.resolve().name}: {label}", label, lines))
            written.append(out / file)
        return written
    except FileNotFoundError:
        return []  # nothing logged yet
    except Exception as e:  # noqa: BLE001 (a curve is never worth the run: any failure is said and training goes on)
        if str(out) not in _warned:
            _warned.add(str(out))
            logger.warning("could not draw the curves in %s (%s: %s); training goes on", out, type(e).__name__, e)
        return []
