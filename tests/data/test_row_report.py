"""Every row accounted for: a truncated or dropped row is named (file:line, why, tokens over) in the log, a bounded
number of lines then a count, and every one is a record of the run's data_report.jsonl; `truncate` never drops a
row silently (a row whose every trained token is cut is dropped with that reason, counted apart); fields a format
does not read are listed once in a warning."""

from __future__ import annotations

import json
import logging
import random

import pytest

from hybridtune.config import DatasetConfig, load_config
from hybridtune.data.build import prepare
from hybridtune.data.formats import to_example
from hybridtune.data.packing import Example, fit_to_length
from hybridtune.data.report import CUT_UNTRAINED, NAMED_IN_LOG, OVERLONG, TRUNCATED, UNTRAINED, fit
from hybridtune.models.tokenizer_files import bundled_tokenizer

SEQ = 64


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


def chat(user: str, reply: str | None = None) -> dict:
    msgs = [{"role": "user", "content": user}]
    return {"messages": msgs + ([{"role": "assistant", "content": reply}] if reply is not None else [])}


def write(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def cfg_for(path, tmp_path, **kw):
    keys = dict(dataset=str(path), sequence_len=SEQ, val_set_size=0, output_dir=str(tmp_path / "out"))
    return load_config(None, {**keys, **kw})


def length(tok, row) -> tuple[int, int]:
    ex = to_example(row, "chat", tok, DatasetConfig(), False, "x")
    return len(ex), sum(ex.loss_mask[1:])


ROWS = [
    chat("2+2=", "4"),  # line 1: fits
    chat("word " * 40, "4"),  # line 2: the reply is past sequence_len: truncation cuts every trained token
    chat("2+2=", "four " * 40),  # line 3: truncated, its reply cut short
    chat("only a question"),  # line 4: nothing to train on
    chat("3+3=", "6"),  # line 5: fits
]


def test_truncated_and_dropped_rows_are_named_with_their_reasons(tok, tmp_path, caplog):
    p = write(tmp_path, ROWS)
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        data = prepare(cfg_for(p, tmp_path), tok)
    by_line = {r["where"]: r for r in data.report}
    assert sorted(by_line) == [f"{p}:2", f"{p}:3", f"{p}:4"]
    n2, t2 = length(tok, ROWS[1])
    assert by_line[f"{p}:2"] == {
        "split": "train",
        "where": f"{p}:2",
        "reason": CUT_UNTRAINED,
        "tokens": n2,
        "sequence_len": SEQ,
        "tokens_over": n2 - SEQ,
        "trained_tokens": t2,
    }
    n3, t3 = length(tok, ROWS[2])
    r3 = by_line[f"{p}:3"]
    assert (r3["reason"], r3["tokens_over"], r3["trained_tokens"]) == (TRUNCATED, n3 - SEQ, t3)
    assert 0 < r3["trained_tokens_cut"] < t3
    assert by_line[f"{p}:4"]["reason"] == UNTRAINED and by_line[f"{p}:4"]["tokens_over"] == 0
    # Trained: lines 1, 5 and line 3 cut to sequence_len.
    assert sorted(len(e) for b in data.bins for e in b) == sorted(
        [length(tok, ROWS[0])[0], length(tok, ROWS[4])[0], SEQ]
    )
    assert data.stats.truncated == 1 and data.stats.dropped == 2
    text = caplog.text
    assert "1 truncated, 2 dropped (1 whose truncation cut every trained token, 1 without a trained token)" in text
    assert (
        f"{p}:2: dropped: truncating to sequence_len={SEQ} cut every trained token ({n2} tokens, {n2 - SEQ} over"
        in text
    )
    assert f"{p}:3: truncated to sequence_len={SEQ} ({n3} tokens, {n3 - SEQ} over; {t3} trained" in text
    assert f"{p}:4: dropped: no trained token" in text
    assert f"{p}:1" not in text and f"{p}:5" not in text


def test_drop_strategy_and_held_out_rows_are_reported(tok, tmp_path):
    rows = [chat(f"{i}+{i}=", str(2 * i)) for i in range(6)] + [chat("2+2=", "four " * 40)]
    p = write(tmp_path, rows)
    data = prepare(cfg_for(p, tmp_path, excess_length_strategy="drop"), tok)
    assert [(r["where"], r["reason"], r["split"]) for r in data.report] == [(f"{p}:7", OVERLONG, "train")]
    # The same row held out (test_datasets): dropped from the eval, as held-out rows are never truncated.
    data = prepare(cfg_for(write(tmp_path, rows[:6], "t.jsonl"), tmp_path, test_datasets=[{"path": str(p)}]), tok)
    assert [(r["where"], r["reason"], r["split"]) for r in data.report] == [(f"{p}:7", OVERLONG, "heldout")]
    assert len(data.eval_examples) == 6


def test_the_log_names_a_bounded_number_of_rows_then_counts(tok, tmp_path, caplog):
    rows = [chat("2+2=", "4")] + [chat("2+2=", "four " * 40) for _ in range(NAMED_IN_LOG + 3)]
    p = write(tmp_path, rows)
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        data = prepare(cfg_for(p, tmp_path), tok)
    assert len(data.report) == NAMED_IN_LOG + 3
    named = [r for r in caplog.records if ": truncated to sequence_len=" in r.getMessage()]
    assert [r.getMessage().split(": truncated")[0] for r in named] == [
        f"data: {p}:{i}" for i in range(2, 2 + NAMED_IN_LOG)
    ]
    assert "data: and 3 more rows truncated or dropped" in caplog.text
    assert "data_report.jsonl" in caplog.text


def test_fit_keeps_what_fit_to_length_keeps():
    rng = random.Random(0)
    examples = []
    for _ in range(300):
        n = rng.randint(1, 40)
        start = rng.randint(0, n + 2)  # where training starts (past the end: no trained token)
        examples.append(Example(list(range(n)), [int(i >= start) for i in range(n)]))
    for strategy in ("truncate", "drop"):
        kept, stats, records = fit(examples, str, 16, strategy)
        ref, ref_stats = fit_to_length(examples, 16, strategy)
        assert kept == ref
        assert stats.dropped == ref_stats.dropped == len([r for r in records if r["reason"] != TRUNCATED])
        assert stats.truncated == len([r for r in records if r["reason"] == TRUNCATED])
        assert len(kept) + stats.dropped == len(examples)


def test_fields_the_format_does_not_read_are_listed_once(tok, tmp_path, caplog):
    rows = [{"instruction": f"{i}+{i}=", "output": str(2 * i), "system": "be terse", "id": i} for i in range(4)]
    p = write(tmp_path, rows)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        prepare(cfg_for(p, tmp_path), tok)
    warned = [r.getMessage() for r in caplog.records if "not read by format" in r.getMessage()]
    assert warned == [f"dataset {p}: fields 'id', 'system' not read by format 'alpaca' (not trained on); map them "
                      "with the field_* keys or drop them"]  # fmt: skip


def test_the_trainer_writes_every_record_to_data_report_jsonl(tok, tmp_path):
    from hybridtune.train.trainer import Trainer

    p = write(tmp_path, ROWS)
    cfg = cfg_for(p, tmp_path, max_steps=1, logging_steps=1)
    t = Trainer(cfg)
    t.setup()
    try:
        lines = (tmp_path / "out" / "data_report.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == t.data.report
        assert [json.loads(line)["where"] for line in lines] == [f"{p}:2", f"{p}:3", f"{p}:4"]
    finally:
        t.close()
