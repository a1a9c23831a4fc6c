"""`hybridtune data` on rows someone else wrote (infer/data_preview.py): a row's terminal control characters are
shown as escapes, never written to the terminal (on a terminal and in a pipe alike), and preference data is filtered
by train's own pair filters, so the preview never shows as trained a pair that `train` drops."""

from __future__ import annotations

import json
import random
import re

import pytest

from hybridtune.cli import main
from hybridtune.infer.data_preview import printable


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _argv(data, tmp_path, *more):
    return ["data", "--dataset", data, "--val_set_size", "0", "--sequence_len", "128", "--output_dir",
            str(tmp_path / "o"), *more]  # fmt: skip


CONTROLS = ["\x1b]0;TITLE\x07", "\x1b[2J", "\x1b[1A\x1b[2K", "\r", "\b", "\x9b31m", "\x7f", "\u202e", "\x00"]


def test_a_rows_control_characters_reach_no_terminal(tmp_path, capsys, monkeypatch):
    rng = random.Random()
    picked = rng.sample(CONTROLS, 5)
    user = "hi " + "".join(f"{c}w{k}" for k, c in enumerate(picked))
    rows = [{"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": "ok \x1b]8;;x\x07l"}]}]
    data = _write(tmp_path / f"ansi\x1b[2J{rng.randrange(99)}.jsonl", rows)
    monkeypatch.setattr("sys.stdout.isatty", lambda: True, raising=False)
    assert main(_argv(data, tmp_path, "--rows", "1")) == 0
    out = capsys.readouterr().out
    shown = out.replace("\x1b[32m", "").replace("\x1b[0m", "")  # (the preview's own green marks, on a terminal)
    assert not re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]", shown), repr(shown)
    for c in picked:
        assert printable(c) in out, (c, out)
    assert "\\x1b[2J" in out  # the file's own name, escaped too


def test_printable_keeps_text_newlines_tabs_and_non_latin_letters():
    text = "line 1\n\tt\u00e9l\u00e9 \u4e2d\u6587 \u05e9\u05dc\u05d5\u05dd \U0001f600"
    assert printable(text) == text
    assert printable("a\x1bb\x9bc\u2066d") == "a\\x1bb\\x9bc\\u2066d"


SAME = {"prompt": [{"role": "user", "content": "1+1="}], "chosen": [{"role": "assistant", "content": "2"}],
        "rejected": [{"role": "assistant", "content": "2"}]}  # fmt: skip


def _pair(chosen, rejected, prompt="q"):
    return {"prompt": [{"role": "user", "content": prompt}], "chosen": chosen, "rejected": rejected}


@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo"])
def test_a_file_of_pairs_train_drops_is_refused_by_data_as_by_train(objective, tmp_path, error_line):
    data = _write(tmp_path / "same.jsonl", [SAME] * random.randint(1, 4))
    line = error_line(_argv(data, tmp_path, "--objective", objective))
    assert "no preference pairs left after filtering" in line, line


def test_dropped_pairs_are_named_and_counted_in_the_preview(tmp_path, capsys):
    good = random.randint(2, 4)
    rows = [_pair([{"role": "assistant", "content": f"yes {k}"}], [{"role": "assistant", "content": f"no {k}"}])
            for k in range(good)]  # fmt: skip
    rows += [SAME, _pair([{"role": "assistant", "content": "  "}], [{"role": "assistant", "content": "x"}])]
    rows += [
        _pair([], [{"role": "assistant", "content": "x"}]),
        {"chosen": "The answer is", "rejected": "The answer is"},
    ]
    data = _write(tmp_path / "mixed.jsonl", rows)
    assert main(_argv(data, tmp_path, "--objective", "dpo", "--rows", str(len(rows)))) == 0
    out = capsys.readouterr().out
    assert f"packing: {len(rows)} preference pairs" in out, out
    assert "none truncated or dropped" not in out
    assert "2 pairs dropped: the chosen and rejected replies are the same" in out, out
    assert "2 pairs dropped: a reply is empty" in out, out
    assert f"{data}:{good + 1} (preference)" in out and out.count("dropped: the chosen and rejected") == 3, out
