"""The bench scripts' command lines checked as they are parsed: `hybridtune bench`, `python -m
hybridtune.bench.generation` and `python -m hybridtune.bench.grpo_pair`. A value out of its range, not a number or a
path of the wrong kind is one line naming the flag, the value and what to give, exit 2 (`OneLineParser`); a
UserError raised later in a `python -m` script is one line too (`run_script`), as under `hybridtune`.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from hybridtune.errors import UserError

WEEK_S = 7 * 24 * 3600.0  # the longest time limit taken, in seconds


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser that says a mistake on the command line in one line (not the usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"error: {message} ({self.prog} --help lists the flags)\n")


def whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"got {text!r}; give a whole number from {low} to {high}")
        return value

    return parse


def number(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a number above `low` and at most `high` (finite)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low < value <= high):
            raise argparse.ArgumentTypeError(f"got {text!r}; give a number above {low:g} and at most {high:g}")
        return value

    return parse


def seconds(text: str) -> float:
    """An argparse type: a time limit in seconds, above 0 and at most a week."""
    return number(0.0, WEEK_S)(text)


def span(low: int, high: int) -> Callable[[str], tuple[int, int]]:
    """An argparse type: `A-B`, whole numbers with low <= A <= B <= high."""

    def parse(text: str) -> tuple[int, int]:
        a, dash, b = text.partition("-")
        try:
            lo, hi = int(a), int(b)
        except ValueError:
            lo = hi = None
        if not dash or lo is None or not low <= lo <= hi <= high:
            raise argparse.ArgumentTypeError(
                f"got {text!r}; give LOW-HIGH, whole numbers with {low} <= LOW <= HIGH <= {high}"
            )
        return lo, hi

    return parse


def _parents_are_folders(text: str, p: Path) -> None:
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise argparse.ArgumentTypeError(f"got {text!r}, but {parent} is a file, not a folder")
            return


def folder(text: str) -> str:
    """An argparse type: a folder to write in; it need not exist, but nothing on its path may be a file."""
    p = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("got an empty path; give a folder")
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"got {text!r}, which is a file; give a folder")
    _parents_are_folders(text, p)
    return text


def file_path(text: str) -> Path:
    """An argparse type: a file to read and write (a results table); it need not exist, but it is not a folder."""
    p = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("got an empty path; give a file's path")
    if p.is_dir():
        raise argparse.ArgumentTypeError(f"got {text!r}, which is a folder; give a file's path")
    _parents_are_folders(text, p)
    return p


def run_script(main: Callable[[list[str]], int]) -> int:
    """A `python -m hybridtune.bench.X` script's entry point: a UserError is one line on stderr and its exit code."""
    try:
        return main(sys.argv[1:])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
