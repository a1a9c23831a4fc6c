"""dpo under `hybridtune train`'s compiled loop (torch.compile under aot_eager, the static layout, the LoRA-off
reference's forward through the same compiled decoder) trains as the same run uncompiled."""

from __future__ import annotations

import json
import random

import pytest

from train_runs import metrics_rows, run_static


@pytest.fixture
def pairs_file(tmp_path) -> str:
    rng = random.Random(2)
    rows = []
    for _ in range(40):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "chosen": [{"role": "assistant", "content": str(a + b)}],
                     "rejected": [{"role": "assistant", "content": str(a + b + 1)}]})  # fmt: skip
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dpo_under_the_compiled_loop_trains_as_uncompiled(tmp_path, pairs_file, aot_eager):
    keys = {"objective": "dpo", "sequence_len": 128, "rpo_alpha": 0.5}
    _, plain = run_static(tmp_path / "off", pairs_file, compile="off", **keys)
    t, compiled = run_static(tmp_path / "loop", pairs_file, compile="loop", **keys)
    assert t.strategy == "loop" and aot_eager  # the compiled loop ran
    assert len(compiled.losses) == 3
    assert compiled.losses == pytest.approx(plain.losses, rel=1e-5, abs=1e-7)
    got, want = metrics_rows(tmp_path / "loop", "train"), metrics_rows(tmp_path / "off", "train")
    for a, b in zip(got, want, strict=True):
        for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "nll_loss"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
