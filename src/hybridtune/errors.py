"""Errors meant for people.

Every error a user can cause by what they typed or the files they gave derives from `UserError`.
The CLI prints its message as one line and exits with code 2; no traceback. The message names
the bad value, where it came from (file, line, key) and what to do.
"""

from __future__ import annotations

import re

# What a terminal obeys rather than shows: C0 controls but newline and tab, DEL, C1 controls, and the bidirectional
# overrides and isolates that reorder what is shown. Text from files someone else wrote (a data row, a path, a role)
# is printed with these as escapes (\x1b, \u202e): in `hybridtune data`'s preview and in every error line.
CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with every character a terminal would obey written as its escape (`\\x1b`, `\\u202e`)."""
    return CONTROLS.sub(lambda m: m.group(0).encode("unicode_escape").decode("ascii"), text)


def did_you_mean(word: str, choices, what: str = "") -> str:
    """ " Did you mean <what>'<nearest>'?" for the closest of `choices`, or "" when none is close."""
    import difflib

    near = difflib.get_close_matches(word, list(choices), n=1)
    return f" Did you mean {what}'{near[0]}'?" if near else ""


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""

    exit_code = 2


class ConfigError(UserError, ValueError):
    """A config key is unknown, ill-typed or out of range."""


class DataError(UserError, ValueError):
    """A dataset file is missing, malformed, or yields no usable examples."""


class ModelError(UserError, ValueError):
    """A model path or preset cannot be loaded."""


class OutputDirError(UserError):
    """The output directory holds another run and `--overwrite` was not given."""


class KernelUnavailableError(UserError, RuntimeError):
    """A required fast kernel is missing or failed its self-test and the policy refuses the slow path."""


class TrainingDiverged(UserError, RuntimeError):
    """The loss or the gradient norm stopped being finite: the run stops before applying the update, exports
    nothing, and exits with code 3 (not an input mistake, not a crash)."""

    exit_code = 3
