"""The tokenizer shipped with the package (built by scripts/build_tokenizer.py) for the tiny presets."""

from __future__ import annotations

import functools
from pathlib import Path

BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parent / "tokenizer"


@functools.lru_cache(maxsize=1)
def bundled_tokenizer():
    """The bundled byte-level BPE tokenizer with a ChatML chat template (a transformers fast tokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER_DIR), trust_remote_code=False)
