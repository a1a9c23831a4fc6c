"""Preference rows someone else wrote (data/pairs.py): a prompt or reply must be text or a list of messages (a number,
a boolean or an object is refused, never trained as its digits), media parts get a message that says preference
pairs take text only so far, and a row with one of chosen/rejected says which is missing. One line naming file:line,
exit 2."""

from __future__ import annotations

import json
import random

import pytest


def _argv(tmp_path, rows, objective="dpo"):
    data = tmp_path / "pref.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ["data", "--objective", objective, "--dataset", str(data), "--sequence_len", "128", "--val_set_size", "0",
            "--output_dir", str(tmp_path / "o")]  # fmt: skip


def _ok(k):
    return {"prompt": f"{k}+1=", "chosen": f"{k + 1}", "rejected": f"{k + 2}"}


@pytest.mark.parametrize(
    "field,value", [("chosen", 2), ("rejected", 2.5), ("chosen", True), ("prompt", 7), ("chosen", {"text": "x"})]
)
def test_a_reply_or_prompt_that_is_not_text_or_messages_is_refused(field, value, tmp_path, error_line):
    rows = [_ok(k) for k in range(random.randint(1, 3))]
    rows.append({**_ok(9), field: value})
    line = error_line(_argv(tmp_path, rows))
    assert f"pref.jsonl:{len(rows)}: field '{field}' is {type(value).__name__}" in line, line
    assert "text or a list of messages" in line


def test_an_image_in_a_preference_row_says_pairs_take_text_only(tmp_path, error_line):
    user = [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "?"}]}]
    row = {"prompt": user, "chosen": [{"role": "assistant", "content": "Red."}],
           "rejected": [{"role": "assistant", "content": "Blue."}]}  # fmt: skip
    line = error_line(_argv(tmp_path, [row], random.choice(["dpo", "simpo", "orpo"])))
    assert "pref.jsonl:1: message 0 of 'prompt', content part 0 is image" in line, line
    assert "preference pairs (dpo, simpo, orpo) train on text only" in line
    assert "only parts of type 'text' can be trained" not in line


@pytest.mark.parametrize("present,missing", [("chosen", "rejected"), ("rejected", "chosen")])
def test_a_row_with_one_reply_names_the_missing_one(present, missing, tmp_path, error_line):
    line = error_line(_argv(tmp_path, [{"prompt": "1+1=", present: "2"}]))
    assert f"has '{present}' but no '{missing}'" in line and "dpo" in line, line
