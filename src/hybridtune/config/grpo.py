"""The keys of `objective: grpo`, by TRL's GRPOConfig names, each with its bounds; the reward functions' entries
(`reward_file`) and the warning about a reward timeout that cannot apply (`grpo_warnings`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridtune.config.keys import Bound, at_least, in_range, key, positive

REWARD_BUILTINS = ("exact_answer", "boxed_answer", "format", "length_penalty")


def _one_each(cfg) -> str:
    return f"must have one weight per reward function ({len(cfg.reward_funcs)} in reward_funcs)"


@dataclass
class GRPOKeys:
    num_generations: int = key(
        8, "grpo: completions sampled per prompt (a group)", at_least(2, "must be at least 2 (a group)")
    )
    max_prompt_length: int = key(512, "grpo: a longer prompt keeps its last max_prompt_length tokens", at_least(1))
    max_completion_length: int = key(256, "grpo: the most tokens a completion has", at_least(1))
    temperature: float = key(1.0, "grpo: sampling temperature of the completions", positive())
    top_p: float = key(
        1.0, "grpo: nucleus sampling mass (1 = off)", Bound(lambda v, cfg: 0 < v <= 1, "must be in (0, 1]")
    )
    epsilon: float = key(
        0.2,
        "grpo: the clipping range of the policy ratio (lower side, and upper without epsilon_high)",
        in_range(0, 1, "must be in [0, 1)"),
    )
    epsilon_high: float | None = key(
        None, "grpo: the upper clipping range (DAPO's clip-higher); null = epsilon", at_least(0, "must be >= 0")
    )
    scale_rewards: Literal["group", "batch", "none"] = key(
        "group", "grpo: advantages divided by the reward std of their group, of the whole step, or not at all"
    )
    num_iterations: int = key(
        1, "grpo: policy updates per batch of completions (their old log-probs kept)", at_least(1)
    )
    mask_truncated_completions: bool = key(False, "grpo: completions cut at max_completion_length train nothing")
    reward_funcs: list[str] = key(
        [],
        "grpo: reward functions, each 'path/to/file.py:function' (your own code) or a built-in: "
        + ", ".join(REWARD_BUILTINS),
        path=True,
    )
    reward_weights: list[float] | None = key(
        None,
        "grpo: one weight per reward function (null = all 1)",
        Bound(lambda v, cfg: v is None or len(v) == len(cfg.reward_funcs), _one_each),
    )
    reward_processes: int = key(
        0,
        "grpo: run your reward functions in this many worker processes, each call within reward_timeout (0 = "
        "in the training process)",
        at_least(0, "must be >= 0 (0 = in process)"),
    )
    reward_timeout: float = key(
        300.0,
        "grpo: seconds a reward call may take in a worker (with reward_processes > 0)",
        positive("must be positive (seconds)"),
    )


def reward_file(spec: str) -> str | None:
    """The file of a `reward_funcs` entry 'path/to/file.py:function' as written, or None (a built-in, a bad entry)."""
    path, sep, name = spec.rpartition(":")
    return path if spec not in REWARD_BUILTINS and sep and path.endswith(".py") and name.isidentifier() else None


def grpo_warnings(cfg, given: set[str]) -> list[str]:
    """`reward_timeout` given while rewards run in the training process, where nothing can stop a call: said, so
    that a timeout the user set is never silently none."""
    if cfg.objective != "grpo" or "reward_timeout" not in given or cfg.reward_processes > 0:
        return []
    return [
        f"config key 'reward_timeout = {cfg.reward_timeout:g}' applies in reward worker processes only: with "
        "reward_processes: 0 (in process) a reward call is never stopped; set reward_processes: 1 (or more)"
    ]
