"""Write the bundled sample dataset: short arithmetic chats a tiny model can learn on a CPU.

    python scripts/make_sample_data.py   # -> src/hybridtune/data/sample/arithmetic.jsonl

Each row is a chat (`messages` with user/assistant roles). The task mixes single- and two-digit
addition and subtraction so a 1M-parameter model visibly learns within a few hundred steps: the
loss falls and exact-match on held-out prompts rises from zero. Deterministic (fixed seed).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "hybridtune" / "data" / "sample" / "arithmetic.jsonl"
N_ROWS = 8000
SEED = 1234


def make_row(rng: random.Random) -> dict:
    digits = rng.choice([1, 1, 2])  # more one-digit problems: they are learned first
    a = rng.randrange(10**digits)
    b = rng.randrange(10**digits)
    if rng.random() < 0.5:
        q, ans = f"{a}+{b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        q, ans = f"{a}-{b}", a - b
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
