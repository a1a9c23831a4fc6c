"""Fixtures of the vision tests: the tiny vision-language checkpoint's tokenizer and its data-side `Vision`
(vl_tiny.py), built once per test module."""

from __future__ import annotations

import pytest
import vl_tiny


@pytest.fixture(scope="module")
def tok():
    """The bundled tokenizer with the vision tokens added."""
    return vl_tiny.tokenizer()


@pytest.fixture(scope="module")
def vision(tok):
    """The data side's `Vision` of the tiny checkpoint (its image and video processors), without a directory."""
    return vl_tiny.vision_of(tok)
