"""Each format turns rows into ids with the right loss mask; bad rows fail with file and line."""

from __future__ import annotations

import json

import pytest
from data_rows import trained_text

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_examples
from hybridtune.data.formats import detect_type, to_example
from hybridtune.data.sources import read_rows
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


def untrained_text(tok, ex) -> str:
    return tok.decode([i for i, m in zip(ex.input_ids, ex.loss_mask) if not m])


def test_text_trains_on_everything(tok):
    ex = to_example({"text": "hello world 12"}, "text", tok, DatasetConfig(), False, "x")
    assert all(ex.loss_mask)
    assert tok.decode(ex.input_ids) == "hello world 12<|im_end|>"


def test_chat_trains_on_assistant_turns_only(tok):
    row = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "2+2="},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "3+3="},
            {"role": "assistant", "content": "6"},
        ]
    }
    ex = to_example(row, "chat", tok, DatasetConfig(), False, "x")
    assert tok.decode(ex.input_ids) == tok.apply_chat_template(row["messages"], tokenize=False)
    # Both replies with their end-of-turn markers (not the newline after them), and nothing of the prompts or headers.
    assert trained_text(tok, ex) == "4<|im_end|>6<|im_end|>"
    assert "assistant" in untrained_text(tok, ex) and "2+2=" in untrained_text(tok, ex)


def test_chat_train_on_inputs_and_custom_roles(tok):
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
    ex = to_example(row, "chat", tok, DatasetConfig(), True, "x")
    assert all(ex.loss_mask)
    # Only the assistant turn has a generation header to leave out; other trained roles train whole.
    ex = to_example(row, "chat", tok, DatasetConfig(roles_to_train=["user"]), False, "x")
    assert trained_text(tok, ex) == "<|im_start|>user\na<|im_end|>"


def test_sharegpt_maps_roles(tok):
    row = {"conversations": [{"from": "human", "value": "5+1="}, {"from": "gpt", "value": "6"}]}
    assert detect_type(row, DatasetConfig(), "x") == "sharegpt"
    ex = to_example(row, "sharegpt", tok, DatasetConfig(), False, "x")
    assert trained_text(tok, ex) == "6<|im_end|>"


def test_alpaca_trains_on_output(tok):
    row = {"instruction": "Add the numbers", "input": "1 2", "output": "3"}
    assert detect_type(row, DatasetConfig(), "x") == "alpaca"
    ex = to_example(row, "alpaca", tok, DatasetConfig(), False, "x")
    assert trained_text(tok, ex) == "3<|im_end|>"
    assert "Add the numbers" in untrained_text(tok, ex) and "1 2" in untrained_text(tok, ex)


def test_alpaca_without_chat_template_uses_prompt_format(tok):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    ex = to_example({"instruction": "Say hi", "output": "hi"}, "alpaca", plain, DatasetConfig(), False, "x")
    assert trained_text(plain, ex) == "hi<|im_end|>"
    assert untrained_text(plain, ex).startswith("### Instruction:\nSay hi")


def test_custom_field_mapping(tok):
    ds = DatasetConfig(field_instruction="q", field_output="a")
    row = {"q": "What?", "a": "That"}
    assert detect_type(row, ds, "x") == "alpaca"
    assert trained_text(tok, to_example(row, "alpaca", tok, ds, False, "x")) == "That<|im_end|>"


def test_jsonl_and_parquet_give_the_same_examples(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"text": f"row {i} " * (i + 1)} for i in range(7)]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = load_examples(DatasetConfig(path=str(jl)), tok)
    b = load_examples(DatasetConfig(path=str(tmp_path / "d.parquet")), tok)
    assert [e.input_ids for e in a] == [e.input_ids for e in b] and len(a) == 7


def test_malformed_json_names_file_and_line(tmp_path):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "ok"}\n\n{"text": "broken"\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: malformed JSON \(Expecting ',' delimiter at column 18\)"):
        list(read_rows(str(p)))


def test_missing_file_and_missing_field(tok, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        list(read_rows(str(tmp_path / "nope.jsonl")))
    p = tmp_path / "d.jsonl"
    p.write_text('{"instruction": "x", "output": "y"}\n{"instruction": "x"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: alpaca row has no field 'output'"):
        load_examples(DatasetConfig(path=str(p), type="alpaca"), tok)
    p.write_text('{"foo": 1}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: cannot tell the format"):
        load_examples(DatasetConfig(path=str(p)), tok)
    p.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:1: message 0 of 'messages' needs 'role' and 'content'"):
        load_examples(DatasetConfig(path=str(p), type="chat"), tok)


def test_empty_file(tok, tmp_path):
    p = tmp_path / "empty.jsonl"
    p.write_text("\n")
    with pytest.raises(DataError, match="has no rows"):
        load_examples(DatasetConfig(path=str(p)), tok)


def test_bundled_sample_loads(tok):
    ex = load_examples(DatasetConfig(path="hybridtune:sample/arithmetic.jsonl"), tok)
    assert len(ex) == 8000
    assert all(any(e.loss_mask) and not e.loss_mask[0] for e in ex[:100])
