from __future__ import annotations

import json
import random

import pytest

from hybridtune.compiler import strategies
from hybridtune.runtime import compose


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> str:
    """A small chat dataset (arithmetic) so CLI tests run in seconds."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    rows = []
    for _ in range(120):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append(
            {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture
def aot_eager(monkeypatch):
    """The trainer's compile_model, real, under the aot_eager backend (inductor's CPU build would cost minutes);
    the handles it made."""
    handles = []

    def compile_(model, strategy, **opts):
        handles.append(strategies.compile_model(model, strategy, backend="aot_eager", **opts))
        return handles[-1]

    monkeypatch.setattr(compose, "compile_model", compile_)
    return handles
