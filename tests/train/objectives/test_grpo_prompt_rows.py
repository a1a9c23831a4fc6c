"""GRPO's prompt rows (train/objectives/grpo_rollouts.py `load_prompts`) checked as training data's rows are: a
prompt that is a number, an object, a list of non-messages, a message without content, null, an empty list or empty
text, and a `messages` chat of bare strings were tracebacks (Jinja's UndefinedError, TypeError, AttributeError,
ValueError) (red team); each is now one DataError naming file:line and the field. Good rows still load, a whole
number as its digits (as training data's text fields take it)."""

from __future__ import annotations

import json

import pytest

from hybridtune.config import TrainConfig
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer
from hybridtune.train.objectives.grpo_rollouts import load_prompts

BAD = {
    "number": ({"prompt": 5.5, "answer": "1"}, r"field 'prompt' \(text or a list of messages\) must be text"),
    "object": ({"prompt": {"role": "user"}, "answer": "1"}, r"field 'prompt' \(text or a list of messages\)"),
    "list of numbers": ({"prompt": [1, 2], "answer": "1"}, r"message 0 of 'prompt' needs 'role' and 'content'"),
    "no content": ({"prompt": [{"role": "user"}], "answer": "1"}, r"message 0 of 'prompt' needs"),
    "null": ({"prompt": None, "answer": "1"}, r"must be text, got null"),
    "empty list": ({"prompt": [], "answer": "1"}, r"field 'prompt' must be a non-empty list of messages"),
    "empty text": ({"prompt": "  ", "answer": "1"}, r"field 'prompt' is empty"),
    "bare strings": ({"messages": ["hi", "there"]}, r"message 0 of 'messages' needs 'role' and 'content'"),
    "bad role": ({"prompt": [{"role": "robot", "content": "hi"}]}, r"message 0 has unknown role 'robot'"),
}


def _cfg(path) -> TrainConfig:
    return TrainConfig(dataset=str(path), objective="grpo", reward_funcs=["exact_answer"])


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_prompt_row_is_one_line_naming_it(tmp_path, tok, case):
    row, pattern = BAD[case]
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError, match=pattern) as e:
        load_prompts(_cfg(path), tok)
    assert str(e.value).startswith(f"{path}:2: ") and "\n" not in str(e.value), str(e.value)


def test_good_rows_still_load(tmp_path, tok):
    rows = [
        {"prompt": "1+1=", "answer": "2"},
        {"prompt": 17, "answer": "17"},
        {"prompt": [{"role": "user", "content": "2+2="}], "answer": "4"},
        {"messages": [{"role": "user", "content": "3+3="}, {"role": "assistant", "content": "6"}]},
    ]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    docs = load_prompts(_cfg(path), tok).prompts
    assert [d.columns.get("answer") for d in docs] == ["2", "17", "4", "6"]
    assert docs[1].prompt == "17" and docs[2].prompt == [{"role": "user", "content": "2+2="}]
    assert docs[3].prompt == [{"role": "user", "content": "3+3="}]
