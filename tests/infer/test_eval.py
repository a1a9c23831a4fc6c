"""`hybridtune eval` gives the numbers the trainer logged for the same examples: a run's final/ and a mid-run
checkpoint on the run's own held-out split, through the command and in-process; exact match only where it means
something; perplexity and token counts."""

from __future__ import annotations

import json
import math

import pytest
from infer_runs import logged_evals

from hybridtune import cli
from hybridtune.infer.evaluate import eval_config, run_eval
from hybridtune.infer.load import open_model

FAMILIES = [
    ("tiny-qwen3_5", "full"),
    ("tiny-qwen3_5", "lora"),
    pytest.param("tiny-qwen3_next", "full", marks=pytest.mark.slow),
    pytest.param("tiny-qwen3_next", "lora", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("preset, adapter", FAMILIES)
def test_eval_equals_the_trainers_logged_eval(trained, preset, adapter):
    out = trained(preset, adapter)
    logged = logged_evals(out)
    for where, step in (("final", 4), ("checkpoint-2", 2)):
        opened = open_model(str(out / where), patched=True)
        res = run_eval(opened, eval_config(opened.run, {}), "heldout", "cpu")
        want = logged[step]
        assert res["step"] == step
        assert res["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6, abs=1e-7), where
        assert res["exact_match"] == want["exact_match"] and res["eval_examples"] == want["eval_examples"] == 8
        assert res["perplexity"] == pytest.approx(math.exp(want["eval_loss"]), rel=1e-5)
    assert logged[2]["eval_loss"] != logged[4]["eval_loss"]  # the two points are different models


def test_eval_command_json_and_a_held_out_file_give_the_same_numbers(trained, tmp_path, capsys, chat_data):
    """`--split heldout` on the run's data, and `--split all` on a file of just those rows, are the logged eval."""
    out = trained("tiny-qwen3_5", "lora")
    assert cli.main(["eval", "--model", str(out), "--split", "heldout", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["eval_loss"] == pytest.approx(logged_evals(out)[4]["eval_loss"], rel=1e-6)
    assert res["formats"] == ["chat"] and res["exact_match"] is not None
    assert res["eval_tokens"] > 0 and res["tokens"] > res["eval_tokens"]
    # The same examples in a file of their own, in the split's order (the split is seeded: data.build.split_heldout).
    from hybridtune.data.build import split_heldout

    rows = [json.loads(line) for line in open(chat_data)]
    _, held = split_heldout(list(range(len(rows))), 8, 42)
    own = tmp_path / "heldout.jsonl"
    own.write_text("".join(json.dumps(rows[i]) + "\n" for i in held))
    assert cli.main(["eval", "--model", str(out / "final"), "--dataset", str(own), "--json"]) == 0
    alone = json.loads(capsys.readouterr().out)
    assert alone["eval_loss"] == pytest.approx(res["eval_loss"], rel=1e-6)
    assert (alone["eval_examples"], alone["eval_tokens"], alone["tokens"]) == (8, res["eval_tokens"], res["tokens"])


def test_plain_text_has_no_exact_match(trained, tmp_path, capsys):
    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"{a} plus {a} is {2 * a}."}) + "\n" for a in range(6)))
    out = trained("tiny-qwen3_5", "full")
    assert cli.main(["eval", "--model", str(out / "final"), "--dataset", str(text)]) == 0
    shown = capsys.readouterr().out
    assert "exact_match  n/a (plain text)" in shown and "examples     6 (all; 0 dropped" in shown
    assert math.isfinite(float(shown.split("eval_loss")[1].split()[0]))


def test_a_model_outside_a_run_needs_a_dataset(capsys):
    assert cli.main(["eval", "--model", "tiny-qwen3_5"]) == 2
    assert "give --dataset" in capsys.readouterr().err


def test_a_dataset_split_is_evaluated_as_the_same_rows_in_a_file(trained, tmp_path, capsys, chat_data):
    """--dataset_split reads one split of a saved dataset (data.sources); the numbers are those of its rows."""
    import datasets

    rows = [json.loads(line) for line in open(chat_data)]
    saved = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows[:50]), "test": datasets.Dataset.from_list(rows[50:])}
    ).save_to_disk(str(saved))
    plain = tmp_path / "test.jsonl"
    plain.write_text("".join(json.dumps(r) + "\n" for r in rows[50:]))
    model = str(trained("tiny-qwen3_5", "full") / "final")
    results = []
    for data in (["--dataset", str(saved), "--dataset_split", "test"], ["--dataset", str(plain)]):
        assert cli.main(["eval", "--model", model, *data, "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[0]["eval_examples"] == len(rows) - 50 == results[1]["eval_examples"]
    assert results[0]["eval_loss"] == pytest.approx(results[1]["eval_loss"], rel=1e-9)
    assert cli.main(["eval", "--model", model, "--dataset_split", "test"]) == 2
    assert "give --dataset too" in capsys.readouterr().err
