"""The keys of `objective: grpo`, by TRL's GRPOConfig names (a leaf: `config_schema.TrainConfig` inherits them), and
their limits (`grpo_checks`, part of `config_schema.range_checks`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

REWARD_BUILTINS = ("exact_answer", "boxed_answer", "format", "length_penalty")


def _k(default: Any, help: str) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class GRPOKeys:
    num_generations: int = _k(8, "grpo: completions sampled per prompt (a group)")
    max_prompt_length: int = _k(512, "grpo: a longer prompt keeps its last max_prompt_length tokens")
    max_completion_length: int = _k(256, "grpo: the most tokens a completion has")
    temperature: float = _k(1.0, "grpo: sampling temperature of the completions")
    top_p: float = _k(1.0, "grpo: nucleus sampling mass (1 = off)")
    epsilon: float = _k(
        0.2, "grpo: the clipping range of the policy ratio (lower side, and upper without epsilon_high)"
    )
    epsilon_high: float | None = _k(None, "grpo: the upper clipping range (DAPO's clip-higher); null = epsilon")
    scale_rewards: Literal["group", "batch", "none"] = _k(
        "group", "grpo: advantages divided by the reward std of their group, of the whole step, or not at all"
    )
    num_iterations: int = _k(1, "grpo: policy updates per batch of completions (their old log-probs kept)")
    mask_truncated_completions: bool = _k(False, "grpo: completions cut at max_completion_length train nothing")
    reward_funcs: list[str] = _k(
        [],
        "grpo: reward functions, each 'path/to/file.py:function' (your own code) or a built-in: "
        + ", ".join(REWARD_BUILTINS),
    )
    reward_weights: list[float] | None = _k(None, "grpo: one weight per reward function (null = all 1)")
    reward_processes: int = _k(
        0,
        "grpo: run your reward functions in this many worker processes, each call within reward_timeout (0 = "
        "in the training process)",
    )
    reward_timeout: float = _k(300.0, "grpo: seconds a reward call may take in a worker (with reward_processes > 0)")


def reward_file(spec: str) -> str | None:
    """The file of a `reward_funcs` entry 'path/to/file.py:function' as written, or None (a built-in, a bad entry)."""
    path, sep, name = spec.rpartition(":")
    return path if spec not in REWARD_BUILTINS and sep and path.endswith(".py") and name.isidentifier() else None


def grpo_checks(cfg) -> list[tuple[bool, str, Any, str]]:
    """(ok, key, value, what it must be) for the grpo keys, as `config_schema.range_checks` lists them."""
    n = len(cfg.reward_funcs)
    return [
        (cfg.num_generations >= 2, "num_generations", cfg.num_generations, "must be at least 2 (a group)"),
        (cfg.max_prompt_length >= 1, "max_prompt_length", cfg.max_prompt_length, "must be at least 1"),
        (cfg.max_completion_length >= 1, "max_completion_length", cfg.max_completion_length, "must be at least 1"),
        (cfg.temperature > 0, "temperature", cfg.temperature, "must be positive"),
        (0 < cfg.top_p <= 1, "top_p", cfg.top_p, "must be in (0, 1]"),
        (0 <= cfg.epsilon < 1, "epsilon", cfg.epsilon, "must be in [0, 1)"),
        (cfg.epsilon_high is None or cfg.epsilon_high >= 0, "epsilon_high", cfg.epsilon_high, "must be >= 0"),
        (cfg.num_iterations >= 1, "num_iterations", cfg.num_iterations, "must be at least 1"),
        (cfg.reward_processes >= 0, "reward_processes", cfg.reward_processes, "must be >= 0 (0 = in process)"),
        (cfg.reward_timeout > 0, "reward_timeout", cfg.reward_timeout, "must be positive (seconds)"),
        (
            cfg.reward_weights is None or len(cfg.reward_weights) == n,
            "reward_weights",
            cfg.reward_weights,
            f"must have one weight per reward function ({n} in reward_funcs)",
        ),
    ]


def grpo_warnings(cfg, given: set[str]) -> list[str]:
    """`reward_timeout` given while rewards run in the training process, where nothing can stop a call: said, so
    that a timeout the user set is never silently none."""
    if cfg.objective != "grpo" or "reward_timeout" not in given or cfg.reward_processes > 0:
        return []
    return [
        f"config key 'reward_timeout = {cfg.reward_timeout:g}' applies in reward worker processes only: with "
        "reward_processes: 0 (in process) a reward call is never stopped; set reward_processes: 1 (or more)"
    ]
