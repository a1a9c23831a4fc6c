from __future__ import annotations

import json
import random

import pytest


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
