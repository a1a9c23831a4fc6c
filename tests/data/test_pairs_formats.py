"""Preference rows (TRL's formats) -> two documents each, through the supervised data path: which tokens are trained
(the replies only), implicit prompts, the tokenised cache, and every bad row as one line naming file:line."""

from __future__ import annotations

import logging

import pytest
from data_rows import trained_text, write

from hybridtune.config import DatasetConfig, load_config
from hybridtune.data.build import load_data
from hybridtune.data.examples import load_source
from hybridtune.data.pairs import PREFERENCE, Pair
from hybridtune.errors import ConfigError, DataError
from hybridtune.models.loading import tokenizer_for
from hybridtune.train.objectives.preference import prepare_data


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for("tiny-qwen3_5")


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


def load(tok, path, **ds):
    return load_source(DatasetConfig(path=path, **ds), tok, cache=False)


def test_conversational_rows_train_the_replies_only(tmp_path, tok):
    rows = [
        {"prompt": [user("2+2=")], "chosen": [bot("4")], "rejected": [bot("5")]},
        {"chosen": [user("2+2="), bot("4")], "rejected": [user("2+2="), bot("5")]},  # implicit prompt
    ]
    got = load(tok, write(tmp_path / "p.jsonl", rows))
    assert got.fmt == PREFERENCE and len(got.examples) == 2 and all(isinstance(p, Pair) for p in got.examples)
    explicit, implicit = got.examples
    assert explicit == implicit  # the shared first message is the prompt
    c, r = explicit.docs()
    assert len(c) + len(r) == len(explicit) and c.input_ids != r.input_ids
    assert trained_text(tok, c) == "4<|im_end|>" and trained_text(tok, r) == "5<|im_end|>"
    want_c = tok.apply_chat_template([user("2+2="), bot("4")], tokenize=False)
    assert tok.decode(c.input_ids) == want_c  # the whole chat, rendered by the template
    prompt = tok.apply_chat_template([user("2+2=")], tokenize=False, add_generation_prompt=True)
    assert tok.decode(c.input_ids).startswith(prompt) and tok.decode(r.input_ids).startswith(prompt)
    assert trained_text(tok, c) not in prompt


def test_text_rows_as_trl_takes_them(tmp_path, tok):
    rows = [
        {"prompt": "Q: 3+3= A:", "chosen": " 6", "rejected": " 7"},
        {"chosen": "Q: 3+3= A: 6", "rejected": "Q: 3+3= A: 7"},  # implicit: the space before the fork: the replies'
    ]
    got = load(tok, write(tmp_path / "t.jsonl", rows)).examples
    assert got[0] == got[1]
    c, r = got[0].docs()
    eos = tok.eos_token
    assert tok.decode(c.input_ids) == "Q: 3+3= A: 6" + eos and tok.decode(r.input_ids) == "Q: 3+3= A: 7" + eos
    assert trained_text(tok, c) == " 6" + eos and trained_text(tok, r) == " 7" + eos


def test_the_tokenised_cache_gives_the_same_pairs(tmp_path, tok, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = write(tmp_path / "p.jsonl", [{"prompt": [user(f"{i}+1=")], "chosen": [bot(str(i + 1))],
                                        "rejected": [bot(str(i + 2))]} for i in range(5)])  # fmt: skip
    first = load_source(DatasetConfig(path=path), tok)
    again = load_source(DatasetConfig(path=path), tok)
    assert again.fmt == PREFERENCE and again.examples == first.examples and len(first.examples) == 5


def test_malformed_rows_are_one_line_naming_file_and_line(tmp_path, tok):
    cases = [
        ({"prompt": "a", "chosen": "b", "rejected": [bot("c")]}, "'prompt' is a string and 'rejected' is a list"),
        ({"chosen": [user("x"), bot("1")], "rejected": [user("y"), bot("2")]}, "no shared prompt"),
        ({"prompt": "a", "chosen": "b", "rejected": None}, "no value in field 'rejected'"),
    ]
    for k, (row, says) in enumerate(cases):
        good = {"prompt": "a", "chosen": "b", "rejected": "c"}
        path = write(tmp_path / f"bad{k}.jsonl", [good, row])
        with pytest.raises(DataError) as e:
            load(tok, path)
        line = str(e.value)
        assert f"bad{k}.jsonl:2" in line and says in line and "\n" not in line, line


def run_cfg(tmp_path, data, **kw):
    return load_config(None, {"base_model": "tiny-qwen3_5", "dataset": data, "objective": "dpo", "val_set_size": 0,
                              "output_dir": str(tmp_path / "out"), **kw})  # fmt: skip


def test_identical_empty_and_overlong_pairs_are_dropped_each_on_a_line(tmp_path, tok, caplog):
    rows = [{"prompt": [user(f"{i}+1=")], "chosen": [bot(str(i + 1))], "rejected": [bot(str(i + 2))]} for i in range(4)]
    rows[1] = {"prompt": [user("1+1=")], "chosen": [bot("2")], "rejected": [bot("2")]}
    rows[2] = {"prompt": "1+1=", "chosen": "", "rejected": "3"}
    rows[3] = {"prompt": [user("9" * 200)], "chosen": [bot("1")], "rejected": [bot("2")]}
    cfg = run_cfg(tmp_path, write(tmp_path / "d.jsonl", rows), sequence_len=64, excess_length_strategy="drop")
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        data = prepare_data(cfg, tok, load_data(cfg, tok))
    assert [r["reason"] for r in data.report] == ["identical_replies", "empty_reply", "longer_than_sequence_len"]
    assert [r["where"].rsplit("/", 1)[-1] for r in data.report] == ["d.jsonl:2", "d.jsonl:3", "d.jsonl:4"]
    lines = [r.getMessage() for r in caplog.records]
    for where, says in (("d.jsonl:2", "are the same"), ("d.jsonl:3", "a reply is empty"), ("d.jsonl:4", "longer")):
        assert sum(where in line and says in line for line in lines) == 1, lines
    summary = next(line for line in lines if "preference pairs ->" in line)
    assert "4 preference pairs -> 1 bins" in summary
    assert "1 empty reply, 1 identical replies, 1 longer than sequence len" in summary
    assert len(data.bins) == 1 and len(data.bins[0]) == 2  # the one good pair: its two documents


def test_truncation_keeps_both_replies_in_one_pack(tmp_path, tok):
    long = "7" * 60
    rows = [{"prompt": [user("q")], "chosen": [bot("1" + long)], "rejected": [bot("2" + long)]}]
    cfg = run_cfg(tmp_path, write(tmp_path / "d.jsonl", rows), sequence_len=48)
    data = prepare_data(cfg, tok, load_data(cfg, tok))
    (record,) = data.report
    assert record["reason"] == "truncated" and record["where"].endswith("/d.jsonl:1")
    (pack,) = data.bins
    assert [d.side for d in pack] == [0, 1] and sum(len(d) for d in pack) <= 48
    assert len(pack[0]) == len(pack[1]) == 24  # two long documents share the room evenly


def test_objective_and_data_must_agree(tmp_path, tok, small_data):
    pref = write(tmp_path / "p.jsonl", [{"prompt": "a", "chosen": "b", "rejected": "c"}] * 3)
    cfg = run_cfg(tmp_path, small_data)
    with pytest.raises(ConfigError, match=r"objective 'dpo' trains on preference pairs, but the data are .*\(chat\)"):
        prepare_data(cfg, tok, load_data(cfg, tok))
    cfg = run_cfg(tmp_path, pref, objective="sft")
    with pytest.raises(
        ConfigError, match=r"the data are preference pairs .* but objective is 'sft'; set objective: dpo"
    ):
        prepare_data(cfg, tok, load_data(cfg, tok))
    cfg = load_config(None, {"datasets": [{"path": pref}, {"path": small_data}], "objective": "dpo"})
    with pytest.raises(DataError, match="mix preference pairs and supervised rows"):
        prepare_data(cfg, tok, load_data(cfg, tok))
    with pytest.raises(ConfigError, match="'simpo_gamma' is set but means nothing for objective 'dpo'"):
        prepare_data(run_cfg(tmp_path, pref, simpo_gamma=1.0), tok, None)
