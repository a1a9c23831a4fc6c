"""Synthetic plain-text documents long enough for 4096-token packs (no download; deterministic).

    python benchmarks/make_long_text.py OUT.jsonl [--docs 200] [--seed 0]

Each row is {"text": ...}: sentences of common words and numbers, 300 to 6000 words per document. The
presets' bundled tokenizer is small (463 entries, close to one token per character), so a document is
2k to 40k tokens: 200 documents give ~190 packs of 4096 tokens, some one truncated document, some several.
The content is meaningless: it is for throughput, not for learning.
"""

from __future__ import annotations

import argparse
import json
import random

WORDS = (
    "the of and to in is was for on that with as by at from his her it an were are which this be or has had "
    "not but also their first one new after who they two its been more other when into time during can all "
    "there would year some most about over than only years city world three people state between many under "
    "water light river small large north south east west early later number part group system house school "
    "music film game team season album history series name line member family place life work war power"
).split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words)), str(rng.randint(1, 9999)))
    return " ".join(words).capitalize() + "."


def document(rng: random.Random) -> str:
    target = rng.randint(300, 6000)
    out, n = [], 0
    while n < target:
        s = sentence(rng)
        out.append(s)
        n += s.count(" ") + 1
    return " ".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--docs", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    with open(a.out, "w") as f:
        for _ in range(a.docs):
            f.write(json.dumps({"text": document(rng)}) + "\n")


if __name__ == "__main__":
    main()
