"""The keys of a run's evaluation, logging and checkpoints: how often it evaluates, logs, profiles and saves, where it
writes (`output_dir`), what it resumes from, and its seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import MAX_INT, Bound, at_least, key

MAX_SEED = MAX_INT  # torch.manual_seed takes a 64-bit value (every int key's bound) and the trainer adds the rank


@dataclass
class RunKeys:
    eval_steps: int = key(
        100, "evaluate every N steps (0: only at the end)", at_least(0, "must be 0 (only at the end) or more")
    )
    eval_max_examples: int = key(
        200,
        "cap on held-out examples per eval",
        at_least(1, "must be at least 1 (to evaluate nothing, set val_set_size: 0)"),
    )
    eval_samples: int = key(
        0,
        "greedy generations logged at each eval, from the prompts of the first held-out chat/alpaca examples",
        at_least(0, "must be 0 (off) or more"),
        Bound(
            lambda v, cfg: not v or cfg.val_set_size > 0 or bool(cfg.test_datasets),
            "needs held-out examples to take prompts from, and val_set_size is 0 with no test_datasets; set one",
            training=True,
        ),
    )
    eval_max_new_tokens: int = key(64, "eval_samples: the most tokens each generation adds", at_least(1))
    logging_steps: int = key(
        10, "log every N steps (the logged loss is the mean over the steps since the last log)", at_least(1)
    )
    report_to: Literal["none", "tensorboard", "wandb"] = key(
        "none", "also send the metrics to TensorBoard (output_dir/runs/<run_name>) or Weights & Biases"
    )
    run_name: str | None = key(
        None,
        "the run's name in TensorBoard / W&B (default: output_dir's name)",
        not_empty="give a name, or leave it out (null) for output_dir's name",
    )
    save_steps: int = key(
        0, "checkpoint every N steps (0: only at the end)", at_least(0, "must be 0 (only at the end) or more")
    )
    save_total_limit: int = key(2, "checkpoints kept (oldest removed first)", at_least(1))
    profile_steps: int = key(
        0,
        "profile N optimizer steps with torch.profiler and write the breakdown to profile-<first>-<last>.json (0: off)",
        at_least(0, "must be 0 (off) or more"),
    )
    output_dir: str = key(
        "outputs/run",
        "where checkpoints, the final model and metrics.jsonl go",
        path=True,
        not_empty="give a directory",
    )
    overwrite: bool = key(False, "allow an output_dir that already holds a different run")
    resume_from_checkpoint: str | None = key(
        None,
        "checkpoint directory, or 'latest' for the newest in output_dir",
        path=True,
        not_empty="give a checkpoint directory or 'latest', or leave it out (null) to start afresh",
    )
    seed: int = key(
        42,
        "random seed (data order, init of LoRA, dropout)",
        Bound(lambda v, cfg: 0 <= v <= MAX_SEED, f"must be between 0 and 2**63 - 1 ({MAX_SEED})"),
    )
