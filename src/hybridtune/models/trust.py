"""Loading what someone else could have written: no code from a model directory ever runs.

One rule for every model, adapter, checkpoint and processor directory: `refuse_custom_code(directory)` reads every
JSON file the directory holds (never executing anything) and refuses, in one line, any that names custom code (an
`auto_map` or `custom_pipelines` key at any depth), is not a regular file or is too large to check. Deny by default:
the file's name does not matter. `from_pretrained(cls, directory)` is the one way a transformers loader is called:
the check, then `trust_remote_code=False`, with transformers' "run the custom code?" prompt switched off for the
loaders transformers calls itself without the flag (an `AutoProcessor`'s video processor).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from hybridtune.errors import ModelError

NO_CODE = {"trust_remote_code": False}
# The keys through which transformers reaches a directory's Python (`auto_map`: class -> module.Class; a config's
# `custom_pipelines`: task -> module.Class). A value that names nothing (a number: a vocabulary's token) is data.
CODE_KEYS = ("auto_map", "custom_pipelines")
MAX_JSON_BYTES = 64 * 2**20  # a config larger than this is not a config
_USE_KNOWN = (
    "use a checkpoint whose model_type transformers itself knows (`hybridtune doctor` lists the supported families), "
    "or delete that key"
)
_checked: dict[tuple, tuple[str, str] | None] = {}  # (path, size, times, inode) -> finding: a 10 MB tokenizer.json once


def _pairs(found: list[str]):
    """json's object_pairs_hook: notes each code key that names something, at any depth (a key given twice: each
    value, not only the last that json keeps)."""

    def hook(pairs: list[tuple[str, object]]) -> dict:
        for key, value in pairs:
            if key in CODE_KEYS and value not in (None, {}, [], "") and not isinstance(value, (int, float)):
                found.append(f"{key} {json.dumps(value)[:200]}")
        return dict(pairs)

    return hook


def _finding(path: Path) -> tuple[str, str] | None:
    """(what, what to do) when `path` (a name ending .json in a model directory) cannot be let through; None."""
    try:
        st = os.stat(path)  # (follows a link: a hub snapshot's files are links to its blobs)
    except OSError as e:
        return f"cannot be read ({e.strerror})", "fix its permissions or remove it"
    if stat.S_ISDIR(st.st_mode):
        return None
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a pipe or a device)", "replace it with the file itself"
    if st.st_size > MAX_JSON_BYTES:
        return f"is {st.st_size} bytes, more than any model file ({MAX_JSON_BYTES})", "remove it"
    key = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)  # (ctime: a write cannot set it back)
    if key in _checked:
        return _checked[key]
    found: list[str] = []
    try:
        with open(path, "rb") as f:
            json.loads(f.read(), object_pairs_hook=_pairs(found))
        result = None
        if found:
            result = f"has {found[0]} (custom code), which hybridtune never runs", _USE_KNOWN
    except RecursionError:
        result = "is nested too deeply to be checked", "restore the file its release (or the run that wrote it) holds"
    except OSError as e:
        result = f"cannot be read ({e.strerror})", "fix its permissions or remove it"
    except ValueError:
        result = None  # not JSON: the loader that reads it says so in its own words, and runs nothing from it
    _checked[key] = result
    return result


def custom_code(directory: str | Path) -> tuple[Path, str] | None:
    """(file, why) for the first JSON file of `directory` (by name) that `refuse_custom_code` refuses, else None."""
    directory = Path(directory)
    try:
        names = sorted(p.name for p in directory.iterdir() if p.name.lower().endswith(".json"))
    except OSError:
        return None  # not a directory: the loader says what is wrong with the name
    for name in names:
        finding = _finding(directory / name)
        if finding:
            return directory / name, f"{finding[0]}; {finding[1]}"
    return None


def refuse_custom_code(directory: str | Path) -> None:
    """ModelError (one line) when a JSON file of `directory` could make transformers run code or could hide it."""
    found = custom_code(directory)
    if found:
        raise ModelError(f"{found[0]} {found[1]}")
    no_prompt()


def no_prompt() -> None:
    """Switch off transformers' interactive "Do you wish to run the custom code? [y/N]": a loader called without
    `trust_remote_code` (by another loader) then raises instead of reading an answer from stdin."""
    from transformers import dynamic_module_utils  # why here: torch-heavy; `custom_code` alone stays light

    dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0


def from_pretrained(cls, directory: str | Path, **kwargs):
    """`cls.from_pretrained(directory, trust_remote_code=False, **kwargs)` after `refuse_custom_code(directory)`:
    the one way hybridtune calls a transformers loader on a directory."""
    refuse_custom_code(directory)
    return cls.from_pretrained(str(directory), **NO_CODE, **kwargs)
