"""The tiny vision-language checkpoint's tokenizer and data-side `Vision` (tests/data/vision/vl_tiny.py) as fixtures,
built once per test module and defined once here for every test folder that uses them: its conftest takes them with
`from vl_fixtures import tok, vision`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "data" / "vision"))  # vl_tiny's folder, from any test folder
import vl_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    """The bundled tokenizer with the tiny vision-language checkpoint's vision tokens added."""
    return vl_tiny.tokenizer()


@pytest.fixture(scope="module")
def vision(tok):
    """The data side's `Vision` of the tiny checkpoint (its image and video processors), without a directory."""
    return vl_tiny.vision_of(tok)
