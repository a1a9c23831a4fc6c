"""Bad field values and bad bytes in data files: one error naming file, line and key, never training text."""

from __future__ import annotations

import json

import pytest
from data_rows import trained_text

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_examples
from hybridtune.data.formats import to_example
from hybridtune.data.sources import read_rows
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


def write_rows(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return p


def chat(reply):
    return {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": reply}]}


# --- item 6: field values that used to become training text ---------------------------------------------------


@pytest.mark.parametrize(
    "reply, got",
    [
        (None, "got null"),
        ({"text": "4"}, "got an object"),
        ([4], "part 0 is a number"),
        ([{"type": "image_url", "image_url": {"url": "x"}}], "part 0 has type 'image_url'"),
        ([{"type": "text", "text": None}], "part 0 has type 'text' but its 'text' is null"),
        (True, "got a boolean"),
        (4.5, "got a number"),
    ],
)
def test_chat_content_that_is_not_text_is_an_error(tok, tmp_path, reply, got):
    p = write_rows(tmp_path, [chat("4"), chat(reply)])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: message 1 \(role 'assistant'\), key 'content'.*{got}"):
        load_examples(DatasetConfig(path=str(p)), tok)


def test_chat_content_parts_of_type_text_are_joined(tok):
    parts = [{"type": "text", "text": "4"}, {"type": "text", "text": ", of course"}]
    ex = to_example(chat(parts), "chat", tok, DatasetConfig(), False, "x")
    assert trained_text(tok, ex) == "4, of course<|im_end|>"
    # A whole number is its own text.
    assert trained_text(tok, to_example(chat(4), "chat", tok, DatasetConfig(), False, "x")) == "4<|im_end|>"


def test_sharegpt_value_that_is_not_text_is_an_error(tok, tmp_path):
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]}
    p = write_rows(tmp_path, [row])
    with pytest.raises(DataError, match=r"d\.jsonl:1: message 1 \(role 'gpt'\), key 'value' must be text, got null;"):
        load_examples(DatasetConfig(path=str(p)), tok)


@pytest.mark.parametrize(
    "row, key",
    [
        ({"instruction": "Add", "output": [19]}, "output"),
        ({"instruction": "Add", "output": {"a": 1}}, "output"),
        ({"instruction": ["Add"], "output": "19"}, "instruction"),
        ({"instruction": "Add", "input": [1, 2], "output": "3"}, "input"),
        ({"instruction": "Add", "output": False}, "output"),
    ],
)
def test_alpaca_fields_that_are_not_text_are_errors(tok, tmp_path, row, key):
    p = write_rows(tmp_path, [{"instruction": "Add", "output": "3"}, row])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: alpaca field '{key}' must be text"):
        load_examples(DatasetConfig(path=str(p), type="alpaca"), tok)


def test_alpaca_null_input_is_no_input(tok):
    ex = to_example(
        {"instruction": "Say hi", "input": None, "output": "hi"}, "alpaca", tok, DatasetConfig(), False, "x"
    )
    assert trained_text(tok, ex) == "hi<|im_end|>" and "None" not in tok.decode(ex.input_ids)


def test_parquet_content_parts(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def parts(reply):
        return {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "2+2="}]},
                {"role": "assistant", "content": reply},
            ]
        }

    rows = [parts([{"type": "text", "text": "4"}]), parts([{"type": "image", "text": None}])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet:row 2: message 1 .*part 0 has type 'image'"):
        load_examples(DatasetConfig(path=str(tmp_path / "d.parquet")), tok)


# --- item 16: unknown chat roles -------------------------------------------------------------------------------


def test_unknown_chat_role_is_an_error(tok, tmp_path):
    row = {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}
    p = write_rows(tmp_path, [chat("4"), row])
    with pytest.raises(
        DataError,
        match=r"d\.jsonl:2: message 1 has unknown role 'wizard' \(key 'role'\); known roles: assistant, system, "
        r"tool, user",
    ):
        load_examples(DatasetConfig(path=str(p)), tok)
    row["messages"][1]["role"] = None
    p = write_rows(tmp_path, [row])
    with pytest.raises(DataError, match=r"d\.jsonl:1: message 1 has unknown role None"):
        load_examples(DatasetConfig(path=str(p)), tok)
    # A role named in roles_to_train is known.
    ex = to_example(
        {"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]},
        "chat",
        tok,
        DatasetConfig(roles_to_train=["wizard"]),
        False,
        "x",
    )
    assert trained_text(tok, ex).startswith("<|im_start|>wizard")


# --- item 14: bytes, BOM, JSON column, directories ---------------------------------------------------------------


def test_invalid_utf8_names_line_and_column(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: not valid UTF-8 at column 14 \(byte 0xe9\)"):
        list(read_rows(str(p)))
    # A gzip file named .jsonl.
    import gzip

    p.write_bytes(gzip.compress(b'{"text": "ok"}\n'))
    with pytest.raises(DataError, match=r"d\.jsonl:1: not valid UTF-8 at column \d+"):
        list(read_rows(str(p)))
    p.write_bytes(b'{"text": "ok"}\n\x00\x00\x00\x00\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: a NUL byte at column 1"):
        list(read_rows(str(p)))


@pytest.mark.parametrize("name, sep", [("d.csv", ","), ("d.tsv", "\t")])
def test_invalid_utf8_in_csv_names_line_and_column(tmp_path, name, sep):
    """A CSV/TSV with bytes that are not UTF-8 names the line and column as a JSONL does (was the decoder's
    'position N' inside a block pandas read)."""
    p = tmp_path / name
    rows = [f"instruction{sep}output", f"add{sep}2", *[f"x{i}{sep}y" for i in range(3000)]]
    rows[1500] = f"mul{sep}3"
    raw = ("\n".join(rows) + "\n").encode().replace(b"mul", b"m\xe9l")
    p.write_bytes(raw)
    with pytest.raises(DataError, match=rf"{name}:1501: not valid UTF-8 at column 2 \(byte 0xe9\)"):
        list(read_rows(str(p)))


def test_cli_csv_error_is_one_line(tmp_path, capfd):
    """datasets logged its own 'Failed to read file ...' line (level ERROR) ahead of the one line."""
    from hybridtune.cli import main

    p = tmp_path / "d.csv"
    p.write_bytes(b"instruction,output\nadd,2\nm\xe9l,3\n")
    rc = main(["train", "--dataset", str(p), "--output_dir", str(tmp_path / "run"), "--max_steps", "1"])
    err = [x for x in capfd.readouterr().err.splitlines() if " INFO " not in x and " WARNING " not in x]
    assert rc == 2 and err == [f"error: {p}:3: not valid UTF-8 at column 2 (byte 0xe9); save the file as UTF-8 text"]


def test_bom_is_accepted(tok, tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\n{"text": "fine"}\n')
    assert [r for _, r in read_rows(str(p))] == [{"text": "ok"}, {"text": "fine"}]
    assert len(load_examples(DatasetConfig(path=str(p)), tok)) == 2


def test_malformed_json_gives_line_and_column(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{"text": "a" "b"}\n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: malformed JSON \(Expecting ',' delimiter at column 14\)"):
        list(read_rows(str(p)))


def test_directory_as_dataset_says_so(tmp_path):
    d = tmp_path / "data.jsonl"
    d.mkdir()
    # A directory is a source when it holds data files or a saved dataset; this one holds neither.
    with pytest.raises(DataError, match=r"dataset path '.*data\.jsonl' is a directory without data files"):
        list(read_rows(str(d)))


def test_cli_data_error_is_one_line(tmp_path, capsys):
    from hybridtune.cli import main

    d = tmp_path / "data.jsonl"
    d.mkdir()
    rc = main(
        ["train", "--dataset", str(d), "--output_dir", str(tmp_path / "run"), "--max_steps", "1", "--warmup_steps", "0"]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "is a directory" in err[0], err


# --- red-team items: null fields and roles_to_train that train nothing -----------------------------------------


def test_null_field_says_null(tok, tmp_path):
    p = write_rows(tmp_path, [{"instruction": None, "output": "x"}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: alpaca row has field 'instruction' but it is null;"):
        load_examples(DatasetConfig(path=str(p), type="alpaca"), tok)
    p = write_rows(tmp_path, [{"text": None}])
    with pytest.raises(DataError, match=r"d\.jsonl:1: text row has field 'text' but it is null;"):
        load_examples(DatasetConfig(path=str(p), type="text"), tok)


def test_roles_to_train_that_never_occur(tok, tmp_path):
    p = write_rows(tmp_path, [chat("4"), chat("5")])
    with pytest.raises(
        DataError,
        match=r"d\.jsonl': roles_to_train \['wizard'\] names no role that occurs in its messages "
        r"\(roles: assistant, user\)",
    ):
        load_examples(DatasetConfig(path=str(p), roles_to_train=["wizard"]), tok)
    with pytest.raises(DataError, match=r"roles_to_train \[\] names no role"):
        load_examples(DatasetConfig(path=str(p), roles_to_train=[]), tok)
    # sharegpt's 'gpt' becomes 'assistant' before roles_to_train applies: say so.
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    p = write_rows(tmp_path, [row])
    with pytest.raises(DataError, match=r"roles_to_train \['gpt'\] names no role.*gpt -> assistant"):
        load_examples(DatasetConfig(path=str(p), roles_to_train=["gpt"]), tok)
    # One role that occurs is enough; train_on_inputs trains everything anyway.
    assert len(load_examples(DatasetConfig(path=str(p), roles_to_train=["gpt", "assistant"]), tok)) == 1
    assert len(load_examples(DatasetConfig(path=str(p), roles_to_train=["gpt"]), tok, train_on_inputs=True)) == 1
