"""`hybridtune train --objective dpo | simpo | orpo` end to end on the CPU: the step line and metrics.jsonl carry the
metrics as TRL names them, the dropped rows reach data_report.jsonl, a preference that is easy to learn is learnt
(reward accuracy rising), and a mismatch of objective and data is one line with exit code 2."""

from __future__ import annotations

import json
import logging
import random

import pytest

from hybridtune.cli import main
from train_runs import make_cfg, metrics_rows, run

TRL_NAMES = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
             "logps/rejected"]  # fmt: skip


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> str:
    """Arithmetic preference pairs (the right sum against a wrong one), one of them identical (dropped)."""
    rng = random.Random(1)
    rows = []
    for _ in range(80):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}],
                     "chosen": [{"role": "assistant", "content": str(a + b)}],
                     "rejected": [{"role": "assistant", "content": str(a + b + rng.choice([-1, 1, 10]))}]})  # fmt: skip
    rows[5]["rejected"] = rows[5]["chosen"]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_dpo_trains_and_logs_trls_metrics(tmp_path, pairs_file, adapter, caplog):
    out = tmp_path / "run"
    cfg = make_cfg(out, pairs_file, objective="dpo", adapter=adapter, max_steps=3, sequence_len=128, rpo_alpha=0.5,
                   lora_dropout=0.0)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        res = run(cfg)
    assert res.steps == 3 and res.final_dir
    rows = metrics_rows(out, "train")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        for name in [*TRL_NAMES, "nll_loss"]:
            assert isinstance(r[name], float), (name, r)
        assert 0 <= r["rewards/accuracies"] <= 1
        assert r["rewards/margins"] == pytest.approx(r["rewards/chosen"] - r["rewards/rejected"], abs=1e-6)
    assert rows[0]["rewards/chosen"] == rows[0]["rewards/rejected"] == 0  # step 1: the policy is its reference
    assert rows[-1]["rewards/margins"] != 0
    lines = [r.getMessage() for r in caplog.records]
    step3 = next(line for line in lines if line.startswith("step     3/3"))
    assert all(f"{name} " in step3 for name in TRL_NAMES), step3
    reference = "adapters switched off" if adapter == "lora" else "a frozen copy of the starting model"
    assert any(line.startswith("reference model: ") and reference in line for line in lines)
    report = [json.loads(line) for line in (out / "data_report.jsonl").read_text().splitlines()]
    assert [(r["where"].rsplit("/", 1)[-1], r["reason"]) for r in report] == [("pairs.jsonl:6", "identical_replies")]


@pytest.mark.parametrize("objective", ["simpo", "orpo"])
def test_the_reference_free_objectives_train(tmp_path, pairs_file, objective):
    out = tmp_path / "run"
    res = run(make_cfg(out, pairs_file, objective=objective, max_steps=2, sequence_len=128, beta=1.0))
    assert res.steps == 2
    (last,) = metrics_rows(out, "train")[-1:]
    assert last["rewards/chosen"] == pytest.approx(last["logps/chosen"] * 1.0)  # beta * the averaged log-prob
    assert ("nll_loss" in last) == (objective == "orpo")


def test_an_easy_preference_is_learnt(tmp_path):
    """Chosen replies say 'yes', rejected ones 'no': the reward accuracy of the last steps beats the first's."""
    rng = random.Random(0)
    rows = [{"prompt": f"{rng.randrange(100)}?", "chosen": " yes", "rejected": " no"} for _ in range(64)]
    data = tmp_path / "yes.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cfg = make_cfg(out, str(data), objective="dpo", adapter="full", max_steps=12, sequence_len=64, learning_rate=1e-3,
                   gradient_accumulation_steps=1, val_set_size=0, lora_dropout=0.0, beta=0.5)  # fmt: skip
    run(cfg)
    acc = [r["rewards/accuracies"] for r in metrics_rows(out, "train")]
    margins = [r["rewards/margins"] for r in metrics_rows(out, "train")]
    assert acc[0] == 0 and min(acc[-3:]) == 1.0, acc
    assert margins[-1] > margins[1] > 0, margins


def test_dpo_on_supervised_data_is_one_line(tmp_path, small_data, capsys):
    rc = main(["train", "--objective", "dpo", "--dataset", small_data, "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("error: objective 'dpo' trains on preference pairs, but the data are "), err
    assert "Traceback" not in "\n".join(err)


def test_eval_of_a_dpo_run_scores_its_held_out_chosen_replies(tmp_path, pairs_file, capsys):
    out = tmp_path / "run"
    run(make_cfg(out, pairs_file, objective="dpo", adapter="lora", max_steps=2, sequence_len=128))
    logged = metrics_rows(out, "eval")[-1]
    capsys.readouterr()
    assert main(["eval", "--model", str(out), "--split", "heldout", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["eval_examples"] == logged["eval_examples"] == 8  # val_set_size 8: the held-out pairs' chosen replies
    assert got["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-5)
    assert got["exact_match"] == pytest.approx(logged["exact_match"]) and got["formats"] == ["preference"]
    assert main(["eval", "--model", str(out), "--json"]) == 0  # every pair's chosen reply
    assert json.loads(capsys.readouterr().out)["eval_examples"] == 80
