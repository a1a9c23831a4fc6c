"""Fixtures of the vision tests: the tiny vision-language checkpoint's tokenizer and its data-side `Vision`
(vl_tiny.py), built once per test module (defined in tests/vl_fixtures.py, which tests/security shares)."""

from __future__ import annotations

from vl_fixtures import tok, vision  # noqa: F401  (the fixtures, taken by this folder's tests)
