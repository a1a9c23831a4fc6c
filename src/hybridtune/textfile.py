"""Reading text files a user gave (configs, data): UTF-8 with an optional byte-order mark, errors that say where
(line and column) a file stops being text, and what a path that is not a regular file is (`not_a_file`). A leaf
module: it imports nothing of ours."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def position(text: str, index: int) -> tuple[int, int]:
    """1-based (line, column) of `text[index]`.

    >>> position("ab\\ncd", 4)
    (2, 2)
    """
    return text.count("\n", 0, index) + 1, index - (text.rfind("\n", 0, index) + 1) + 1


def utf8_error(raw: bytes, e: UnicodeDecodeError, first_line: int = 1) -> str:
    """'LINE: not valid UTF-8 at column COLUMN (byte 0xNN)' for a decode error in `raw`, whose first line is
    `first_line` of its file (columns count characters).

    >>> try:
    ...     b"ok\\nab\\xffc".decode("utf-8")
    ... except UnicodeDecodeError as e:
    ...     utf8_error(b"ok\\nab\\xffc", e)
    '2: not valid UTF-8 at column 3 (byte 0xff)'
    """
    start = raw.rfind(b"\n", 0, e.start) + 1
    line = raw.count(b"\n", 0, e.start) + first_line
    column = len(raw[start : e.start].decode("utf-8", errors="replace")) + 1
    return f"{line}: not valid UTF-8 at column {column} (byte 0x{raw[e.start]:02x})"


def nul_error(text: str, what: str, first_line: int = 1) -> str | None:
    """'LINE: a NUL byte at column C: this is a binary file, not WHAT' when `text` holds a NUL, else None."""
    if "\0" not in text:
        return None
    line, column = position(text, text.index("\0"))
    return f"{line + first_line - 1}: a NUL byte at column {column}: this is a binary file, not {what}"


def read_utf8(p: Path, what: str, error: type[Exception]) -> str:
    """The text of file `p` (UTF-8, a byte-order mark allowed); bytes that are not, or a NUL, raise `error` naming
    the line and column. `what` names the expected content ("YAML text")."""
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise error(f"{p}:{utf8_error(raw, e)}; save the file as UTF-8 text") from None
    nul = nul_error(text, what)
    if nul:
        raise error(f"{p}:{nul}") from None
    return text


def not_a_file(path: str | Path) -> str:
    """What `path` is when it is not a regular file, for 'FILE {it}': 'does not exist', 'is a directory', 'is a
    pipe (FIFO), not a file', 'is a device, not a file'...; '' for a regular file (a link followed to one)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISREG(mode):
        return ""
    if stat.S_ISDIR(mode):
        return "is a directory"
    kind = "pipe (FIFO)" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode) else "device"
    return f"is a {kind}, not a file"
