"""The toy mixer's fixture; the mixer itself is toy_spec.py (a module name of its own: several conftest modules share
the name `conftest`, and the compiled toy's guards look its globals up by module name)."""

from __future__ import annotations

import pytest
from toy_spec import KIND, make_spec

from hybridtune.mixers import register, unregister


@pytest.fixture
def toy_mixer():
    """The toy registered first (its family and layer type win over GDN's), removed afterwards (the registry clears
    its consumers' caches both times)."""
    spec = register(make_spec(), first=True)
    try:
        yield spec
    finally:
        unregister(KIND)
