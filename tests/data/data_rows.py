"""What the data tests share: a JSONL file of rows, and the text an example trains on."""

from __future__ import annotations

import json


def write(path, rows) -> str:
    """`rows` as JSON lines in `path`; its path as text."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def trained_text(tok, ex) -> str:
    """The decoded tokens of example `ex` that its loss mask trains on."""
    return tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if m])
