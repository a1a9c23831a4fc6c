"""The examples in docstrings (`>>>`) are run: every module of the package that has one."""

from __future__ import annotations

import doctest
import importlib
import importlib.util
import pkgutil
from pathlib import Path

import pytest

import hybridtune


def _modules_with_examples() -> list[str]:
    names = []

    def failed(name: str) -> None:
        raise ImportError(f"{name} does not import, so its examples cannot be collected")

    for info in pkgutil.walk_packages(hybridtune.__path__, "hybridtune.", onerror=failed):
        spec = importlib.util.find_spec(info.name)
        if spec and spec.origin and spec.origin.endswith(".py"):
            if ">>> " in Path(spec.origin).read_text(encoding="utf-8"):
                names.append(info.name)
    return names


MODULES = _modules_with_examples()


def test_examples_were_found():
    assert {"hybridtune.runtime.stream", "hybridtune.runtime.profiling", "hybridtune.runtime.distributed"} <= set(
        MODULES
    )


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0, result
