"""Write the bundled sample dataset: short arithmetic chats a tiny model can learn on a CPU.

    python scripts/make_sample_data.py   # -> src/hybridtune/data/sample/arithmetic.jsonl

Each row is a chat (`messages` with user/assistant roles): half single-digit addition, 30%
single-digit subtraction, 20% two-digit plus one-digit addition. A 1M-parameter model learns the
single-digit facts within a few hundred steps on a CPU (loss falls, exact match on held-out rows
rises from zero); the two-digit share shows how far it gets with carrying. Deterministic (fixed seed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "hybridtune" / "data" / "sample" / "arithmetic.jsonl"
N_ROWS = 8000
SEED = 1234


def make_row(rng: random.Random) -> dict:
    kind = rng.random()
    if kind < 0.5:  # single-digit addition: 100 facts, learned first
        a, b = rng.randrange(10), rng.randrange(10)
        q, ans = f"{a}+{b}", a + b
    elif kind < 0.8:  # single-digit subtraction without negatives: 55 facts
        a, b = rng.randrange(10), rng.randrange(10)
        a, b = max(a, b), min(a, b)
        q, ans = f"{a}-{b}", a - b
    else:  # two digits plus one: 900 problems, mostly unseen in held-out rows; needs carrying
        a, b = rng.randrange(10, 100), rng.randrange(10)
        q, ans = f"{a}+{b}", a + b
    return {"messages": [{"role": "user", "content": f"{q}="}, {"role": "assistant", "content": str(ans)}]}


def main() -> None:
    rng = random.Random(SEED)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="ascii") as f:
        for _ in range(N_ROWS):
            f.write(json.dumps(make_row(rng), separators=(",", ":")) + "\n")
    print(f"wrote {N_ROWS} rows to {OUT}")


if __name__ == "__main__":
    main()
