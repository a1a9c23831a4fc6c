"""`hybridtune train [CONFIG.yaml] [--key value ...]`."""

from __future__ import annotations

import logging
import sys

from hybridtune.config import config_help, load_config, parse_overrides

logger = logging.getLogger(__name__)

USAGE = """usage: hybridtune train [CONFIG.yaml] [--key value ...]

Fine-tune a model. With no arguments: LoRA on the tiny Qwen3.5 preset with the bundled arithmetic
chats (a few minutes on a CPU). A YAML file sets keys; --key value (or --key=value) overrides them.
--dataset FILE is the shorthand for one data file (format detected, or --dataset_type).
"""


def main(argv: list[str]) -> int:
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        print(config_help())
        return 0
    path = None
    if argv and not argv[0].startswith("--"):
        path, argv = argv[0], argv[1:]
    cfg = load_config(path, parse_overrides(argv))

    from hybridtune.train.loop import Trainer

    trainer = Trainer(cfg)
    trainer.setup()
    progress = _progress(trainer.total_steps, trainer.step)
    if progress is not None:
        trainer.on_log = lambda rec: progress.update(rec)
    try:
        result = trainer.train()
    finally:
        if progress is not None:
            progress.stop()
    if result.interrupted:
        return 130
    first, last = (result.losses[0], result.losses[-1]) if result.losses else (float("nan"), float("nan"))
    summary = f"done: {result.steps} steps, loss {first:.4f} -> {last:.4f}"
    if len(result.evals) >= 2:
        summary += f", exact_match {result.evals[0]['exact_match']:.3f} -> {result.evals[-1]['exact_match']:.3f}"
    summary += f"; final model in {result.final_dir}"
    logger.info("%s", summary)
    return 0


class _Bar:
    def __init__(self, total: int, done: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.p = Progress(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
            transient=True,
        )
        self.task = self.p.add_task("train", total=total, completed=done, loss="-")
        self.p.start()

    def update(self, rec: dict) -> None:
        self.p.update(self.task, completed=rec["step"], loss=f"{rec['loss']:.3f}")

    def stop(self) -> None:
        self.p.stop()


def _progress(total: int, done: int):
    """A progress bar on an interactive terminal only (logs and CI get the step lines alone)."""
    if not sys.stderr.isatty():
        return None
    return _Bar(total, done)
