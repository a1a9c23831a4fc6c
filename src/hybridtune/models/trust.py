"""Loading what someone else could have written: no code from a model directory ever runs.

Every transformers `from_pretrained` hybridtune makes passes `NO_CODE` (`trust_remote_code=False`), and
`refuse_custom_code(directory)` first reads the directory's JSON files (never executing anything) and refuses one
that names custom code (`auto_map`), so the user gets one line instead of transformers' interactive prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

from hybridtune.errors import ModelError

NO_CODE = {"trust_remote_code": False}
# The files through which transformers reaches a directory's Python (`auto_map`: class -> module.Class).
CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
_MAX_JSON_BYTES = 64 * 2**20  # a config larger than this is not a config


def custom_code(directory: str | Path) -> tuple[Path, list[str]] | None:
    """(file, the classes it maps to custom code) for the first of CODE_FILES with an `auto_map`, else None."""
    for name in CODE_FILES:
        path = Path(directory) / name
        try:
            if not path.is_file() or path.stat().st_size > _MAX_JSON_BYTES:
                continue
            data = json.loads(path.read_bytes())
        except (OSError, ValueError):
            continue  # unreadable or not JSON: the loader that reads it says so in its own words
        auto_map = data.get("auto_map") if isinstance(data, dict) else None
        if auto_map:
            targets = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
            return path, sorted({str(t if isinstance(t, str) else list(t)) for t in targets})
    return None


def refuse_custom_code(directory: str | Path) -> None:
    """ModelError (one line) when `directory` would make transformers run its own Python."""
    found = custom_code(directory)
    if found:
        path, classes = found
        raise ModelError(
            f"{path} has auto_map (custom code: {', '.join(classes)[:200]}), which hybridtune never runs; use a "
            "checkpoint whose model_type transformers itself knows (`hybridtune doctor` lists the supported families)"
        )
