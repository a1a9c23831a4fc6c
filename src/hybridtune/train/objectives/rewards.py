"""GRPO's rewards as plain Python: `reward_funcs` entries are `path/to/file.py:function` (the user's own file, read
once from the path the config names, relative to the working directory as every config path is; its sha256 is in
the run record, so a resume with an edited file is refused) or a built-in, weighted by `reward_weights`. A function
is called as TRL's GRPOTrainer calls it, `fn(prompts=, completions=, completion_ids=, trainer_state=, **columns)`,
one entry per completion (a chat prompt's completion as `[{"role": "assistant", "content": text}]`, a plain one's as
text; docs/CONFIG.md has the table), inside reward_fence.py's fence (fresh copies, the working directory kept), and
returns one number per completion (a Python or numpy number, a 0-d tensor; None: TRL's "no reward", counted as 0).
One that raises anything, returns anything else, or rewards that overflow once weighted and normalised, is one line
naming it and the row (exit 2).

Built-ins (either completion form): exact_answer (1 when the completion's answer, its last \\boxed{...}, else the
text after its last "answer:" or "####", else its last number, equals the row's `answer`; numbers compare as
numbers), boxed_answer (the same from a \\boxed{...} only), format (1 when every <think> is closed and an answer can
be extracted), length_penalty (-completion tokens / max_completion_length).
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridtune.config import reward_file
from hybridtune.errors import ConfigError, UserError, did_you_mean
from hybridtune.textfile import not_a_file
from hybridtune.train.objectives.reward_fence import Failed, RaisedInWorker, call, raised_line, user_function
from hybridtune.train.objectives.reward_pool import Pool, TimedOut


class RewardError(UserError):
    """A reward function raised, called sys.exit, returned a non-number or rewards that overflow: one line naming it
    and the row (exit 2)."""


BIG = 1e150  # a reward past this overflows the squares of its group's std
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_LINE = re.compile(r"(?:answer\s*(?:is)?\s*[:=]?|####)\s*(.+)", re.IGNORECASE)


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def extract_answer(text: str) -> str | None:
    """A completion's answer: its last \\boxed{}, else after its last 'answer:' / '####', else its last number."""
    if (b := boxed(text)) is not None:
        return b
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return lines[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def same_answer(got: str | None, want) -> bool:
    """Equal after trimming (and `$`, thousands commas); numbers compare by value."""
    if got is None or want is None:
        return False
    a, b = (str(x).strip().strip("$").replace(",", "").strip() for x in (got, want))
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    except ValueError:
        return a == b


def completion_text(completion) -> str:
    """A completion's text: itself (a plain prompt's), or its messages' contents (a chat prompt's, as TRL gives it)."""
    if isinstance(completion, str):
        return completion
    return "".join(m["content"] for m in completion if isinstance(m, dict) and isinstance(m.get("content"), str))


def exact_answer(completions, answer=None, **_) -> list[float]:
    texts = map(completion_text, completions)
    return [float(same_answer(extract_answer(c), a)) for c, a in zip(texts, answer or [None] * len(completions))]


def boxed_answer(completions, answer=None, **_) -> list[float]:
    texts = map(completion_text, completions)
    return [float(same_answer(boxed(c), a)) for c, a in zip(texts, answer or [None] * len(completions))]


def format_reward(completions, **_) -> list[float]:
    texts = map(completion_text, completions)
    return [float(c.count("<think>") == c.count("</think>") and extract_answer(c) is not None) for c in texts]


def length_penalty(max_completion_length: int) -> Callable[..., list[float]]:
    def length_penalty(completions, completion_ids, **_) -> list[float]:
        return [-len(ids) / max_completion_length for ids in completion_ids]

    return length_penalty


@dataclass
class RewardFunc:
    name: str  # as the config names it
    fn: Callable[..., Sequence]


def load_reward_funcs(
    specs: Sequence[str], max_completion_length: int, processes: int = 0, timeout: float = 0.0
) -> list[RewardFunc]:
    """The config's `reward_funcs`, each resolved (a user's file imported once); a bad entry is one line.
    `processes` > 0: the user's functions run in that many worker processes (reward_pool.py), each call within
    `timeout` seconds."""
    if not specs:
        raise ConfigError(
            "objective grpo needs reward_funcs: e.g. [exact_answer] (the completion's answer equals the row's "
            "'answer') or [rewards.py:correct] (a function in your file)"
        )
    builtins = {"exact_answer": exact_answer, "boxed_answer": boxed_answer, "format": format_reward,
                "length_penalty": length_penalty(max_completion_length)}  # fmt: skip
    out, files = [], []
    for spec in specs:
        if spec in builtins:
            out.append(RewardFunc(spec, builtins[spec]))
            continue
        path = reward_file(spec)
        if path is None:
            raise ConfigError(
                f"config key 'reward_funcs' entry '{spec}' is neither a built-in ({', '.join(builtins)}) nor "
                f"'file.py:function'{did_you_mean(spec, builtins)}"
            )
        file, name = Path(path).expanduser(), spec.rpartition(":")[2]
        if not file.is_file():
            it = not_a_file(file)  # (a pipe or a device, not only a missing file)
            it = f"no file {file}" if it == "does not exist" else f"{file} {it}"
            raise ConfigError(f"config key 'reward_funcs' entry '{spec}': {it} (relative to {Path.cwd()})")
        source = file.read_bytes()  # (read once: a worker runs these bytes too)
        files.append((len(out), file.absolute(), name, spec, source))
        out.append(RewardFunc(spec, user_function(file, name, spec, source)))
    if processes > 0 and files:
        try:
            pool = Pool(files, processes, timeout)
        except RaisedInWorker as e:
            raise ConfigError(
                f"config key 'reward_processes': {e.line}; set reward_processes: 0 to run the rewards in process"
            ) from None
        for i, *_ in files:
            out[i] = RewardFunc(out[i].name, pool.proxy(i, out[i].name))
    return out


def score(
    funcs: Sequence[RewardFunc],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    where: list[str],
    trainer_state=None,
) -> torch.Tensor:
    """Rewards `[B, F]` (float64) of B completions (text, or a chat prompt's list of messages) by F functions, each
    called inside the fence with copies of the arguments; `where[i]`: completion i's row, for errors;
    `trainer_state`: TRL's keyword (a transformers TrainerState), passed when given."""
    out = torch.zeros(len(completions), len(funcs), dtype=torch.float64)
    state = {} if trainer_state is None else {"trainer_state": trainer_state}
    for f, rf in enumerate(funcs):
        try:
            got = call(rf.name, rf.fn, prompts=prompts, completions=completions, completion_ids=completion_ids,
                       **state, **columns)  # fmt: skip
        except Failed as e:  # the user's code: named, with the row it fails on, in one line
            if isinstance(e.raised, TimedOut):  # (never retried row by row: each would wait as long)
                raise RewardError(
                    f"reward function '{rf.name}' did not return within reward_timeout {e.raised.timeout:g} s on the "
                    f"rows of {where[0]} onwards (its worker processes were stopped); make it faster, or raise "
                    "reward_timeout"
                ) from None
            # (sys.exit in a reward would end the run as if it had finished; Ctrl-C's KeyboardInterrupt passes)
            i = _failing_row(rf, prompts, completions, completion_ids, columns, state)
            row = f"row {where[i]} (completion {i})" if i is not None else f"the rows of {where[0]} onwards"
            hint = ""
            if isinstance(e.raised, TypeError) and "unexpected keyword argument" in str(e.raised):
                hint = (f"; a reward takes **kwargs, as TRL requires (it is given prompts, completions, completion_ids, "
                        f"trainer_state and the columns {sorted(columns)} by keyword)")  # fmt: skip
            raise RewardError(
                f"reward function '{rf.name}' raised {raised_line(e.raised)} on {row}{hint}"
            ) from e.raised
        if not isinstance(got, (list, tuple)) or len(got) != len(completions):
            raise RewardError(
                f"reward function '{rf.name}' returned {type(got).__name__} "
                f"{'of length ' + str(len(got)) if isinstance(got, (list, tuple)) else ''}; it must return a list "
                f"of {len(completions)} numbers, one per completion (row {where[0]} first)"
            )
        for i, v in enumerate(got):
            if v is None:
                continue
            try:
                x, why = _as_float(v), ""
            except OverflowError:  # an int (or Fraction) past float's range
                x, why = math.inf, " (too large for a float)"
            if x is None or not math.isfinite(x):
                raise RewardError(
                    f"reward function '{rf.name}' returned {_shown(v)}{why} for completion {i} of row {where[i]}; it "
                    "must return a finite number (a Python or numpy number, a 0-d tensor) or None for no reward"
                )
            out[i, f] = x
    return out


def _as_float(v) -> float | None:
    """A reward as a float: a real number (Python's, numpy's, a 0-d tensor or array), else None. OverflowError: an
    int past float's range."""
    if isinstance(v, bool):
        return None
    if isinstance(v, torch.Tensor):
        return float(v) if v.ndim == 0 and v.dtype != torch.bool and not v.is_complex() else None
    if isinstance(v, numbers.Real):  # int, float, Fraction, numpy's ints and floats (not numpy's bool)
        return float(v)
    if getattr(v, "shape", None) == () and getattr(getattr(v, "dtype", None), "kind", "") in ("i", "u", "f"):
        return float(v)  # a 0-d numpy array
    return None


def _shown(v) -> str:
    """`repr(v)`, cut to one short line."""
    try:
        text = repr(v)
    except ValueError:  # an int with more digits than Python will print
        text = f"an integer of {v.bit_length()} bits"
    text = " ".join(text.split())
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


def total_rewards(
    funcs: Sequence[RewardFunc],
    rewards: torch.Tensor,
    weights: Sequence[float] | None,
    G: int,
    where: list[str],
    scale: str = "group",
) -> torch.Tensor:
    """Each completion's reward `[B]` (`weighted`), checked finite with its group's mean and std (and the step's
    std under scale_rewards: batch): rewards that overflow are one line naming the functions and the row."""
    total = weighted(rewards, weights)
    grouped = total.view(-1, G)
    group_ok = torch.isfinite(grouped.mean(1)) & torch.isfinite(grouped.std(1))
    bad = ~torch.isfinite(total) | ~group_ok.repeat_interleave(G)
    if not bad.any() and scale == "batch" and total.numel() > 1 and not math.isfinite(float(total.std())):
        bad = total.abs() == total.abs().max()
    if not bad.any():
        return total
    i = int(bad.nonzero()[0])
    w = torch.tensor([1.0] * len(funcs) if weights is None else list(weights), dtype=rewards.dtype)
    terms = (rewards[i - i % G : i - i % G + G] * w).abs().amax(0)  # each function's largest in the group
    names = [rf.name for rf, t in zip(funcs, terms.tolist()) if not t < BIG] or [funcs[int(terms.argmax())].name]
    raise RewardError(
        f"reward function{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)} returned rewards that "
        f"overflow (largest weighted {float(terms.max()):.3g}): weighted, summed and normalised (mean, std), those "
        f"of row {where[i]} (completion {i}) are not finite; return rewards of an ordinary size (e.g. within +-1e6)"
    )


def _failing_row(rf: RewardFunc, prompts, completions, completion_ids, columns, state: dict) -> int | None:
    """The first completion that the function raises on when called with it alone (None: only together)."""
    for i in range(len(completions)):
        try:
            one = {k: v[i : i + 1] for k, v in columns.items()}
            call(rf.name, rf.fn, prompts=prompts[i : i + 1], completions=completions[i : i + 1],
                 completion_ids=completion_ids[i : i + 1], **state, **one)  # fmt: skip
        except Failed:
            return i
    return None


def weighted(rewards: torch.Tensor, weights: Sequence[float] | None) -> torch.Tensor:
    """Each completion's reward `[B]`: the functions' rewards `[B, F]` times their weights, summed."""
    if weights is None:
        return rewards.sum(1)
    return rewards @ torch.tensor(list(weights), dtype=rewards.dtype)


def reward_metrics(funcs: Sequence[RewardFunc], rewards: torch.Tensor, total: torch.Tensor, G: int) -> dict:
    """TRL's names: rewards/<name>/mean and /std per function, reward, reward_std (mean of the groups' stds),
    frac_reward_zero_std (groups whose rewards are all equal)."""
    out = {}
    for f, rf in enumerate(funcs):
        key = Path(rf.name.partition(":")[2]).name if ":" in rf.name else rf.name
        out[f"rewards/{key}/mean"] = float(rewards[:, f].mean())
        out[f"rewards/{key}/std"] = float(rewards[:, f].std()) if rewards.shape[0] > 1 else 0.0
    stds = total.view(-1, G).std(1)
    out |= {"reward": float(total.mean()), "reward_std": float(stds.mean())}
    out["frac_reward_zero_std"] = float((stds < 1e-12).double().mean())
    return out
