"""Chats in CSV and other flat files: a cell of a column that must hold a list or an object (messages,
conversations, tools, a conversational prompt/completion) holds its JSON text, decoded; a cell that is not such JSON
is an error saying 'got a string' with the file and row."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig, load_config
from hybridtune.data.build import prepare
from hybridtune.data.examples import load_examples
from hybridtune.data.formats import to_example
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


@pytest.fixture(scope="module")
def tools_tok():
    """The bundled tokenizer with Qwen3.5's template, which renders a row's tools (the bundled one ignores them, and
    a row that carries tools is refused with it)."""
    tok = copy.deepcopy(bundled_tokenizer())
    tok.chat_template = (Path(__file__).parent / "qwen3_5_chat_template.jinja").read_text()
    return tok


def messages(q: str, a: str) -> list[dict]:
    return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]


def write_csv(path, header, rows, sep=","):
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f, delimiter=sep)
        w.writerow(header)
        w.writerows(rows)
    return path


@pytest.mark.parametrize("suffix, sep", [(".csv", ","), (".tsv", "\t")])
def test_a_csv_chat_trains_as_the_same_rows_in_jsonl(tools_tok, tmp_path, suffix, sep):
    tok = tools_tok
    chats = [(messages("2+2=", "4"), TOOLS), (messages("3+3=", "6"), None)]
    flat = write_csv(
        tmp_path / f"d{suffix}",
        ["messages", "tools"],
        [[json.dumps(m), json.dumps(t) if t else ""] for m, t in chats],
        sep,
    )
    jsonl = tmp_path / "d.jsonl"
    jsonl.write_text("".join(json.dumps({"messages": m, **({"tools": t} if t else {})}) + "\n" for m, t in chats))
    got = load_examples(DatasetConfig(path=str(flat)), tok, cache=False)
    assert got == load_examples(DatasetConfig(path=str(jsonl)), tok, cache=False)
    # and it trains: prepare packs it (the trainer's data path)
    keys = {"dataset": str(flat), "val_set_size": 0, "sequence_len": 1024, "output_dir": str(tmp_path / "o")}
    cfg = load_config(None, keys)
    assert sum(len(b) for b in prepare(cfg, tok).bins) == 2


def test_sharegpt_and_conversational_prompt_completion_cells(tok, tmp_path):
    conv = [{"from": "human", "value": "2+2="}, {"from": "gpt", "value": "4"}]
    p = write_csv(tmp_path / "s.csv", ["conversations"], [[json.dumps(conv)]])
    assert load_examples(DatasetConfig(path=str(p)), tok, cache=False) == [
        to_example({"messages": messages("2+2=", "4")}, "chat", tok, DatasetConfig(), False, "x")
    ]
    prompt, completion = [messages("2+2=", "4")[0]], [messages("2+2=", "4")[1]]
    p = write_csv(tmp_path / "pc.csv", ["prompt", "completion"], [[json.dumps(prompt), json.dumps(completion)]])
    [ex] = load_examples(DatasetConfig(path=str(p)), tok, cache=False)
    assert tok.decode(ex.input_ids).startswith("<|im_start|>user\n2+2=")
    # A plain-text prompt that happens to start with '[' stays text (only both cells as lists are decoded).
    p = write_csv(tmp_path / "pt.csv", ["prompt", "completion"], [['["a", "b"] reversed is', ' ["b", "a"]']])
    [ex] = load_examples(DatasetConfig(path=str(p)), tok, cache=False)
    assert tok.decode(ex.input_ids).startswith('["a", "b"] reversed is ["b", "a"]')


@pytest.mark.parametrize(
    "cell, said",
    [
        ("hello there", "got a string that is not JSON (Expecting value at column 1) ('hello there')"),
        ('[{"role": "user"', "got a string that is not JSON"),
    ],
)
def test_a_cell_that_is_not_json_says_got_a_string(tok, tmp_path, cell, said):
    p = write_csv(tmp_path / "d.csv", ["messages"], [[json.dumps(messages("2+2=", "4"))], [cell]])
    with pytest.raises(DataError) as e:
        load_examples(DatasetConfig(path=str(p), type="chat"), tok, cache=False)
    assert str(e.value).startswith(f"{p}:row 2: field 'messages' must be a non-empty list of messages, got a string")
    assert said in str(e.value)
    # The same cell in the first row, where the format is detected: the same words, not 'cannot tell the format'.
    p = write_csv(tmp_path / "e.csv", ["messages", "tools"], [[cell, ""]])
    with pytest.raises(DataError, match=r"e\.csv:row 1: field 'messages' must be a list of messages, got a string"):
        load_examples(DatasetConfig(path=str(p)), tok, cache=False)
