"""An error line quotes what someone else wrote (a row's role, an image path, a file name): its terminal control
characters are printed as escapes, so a data file cannot retitle, clear or rewrite the terminal through `error:`."""

from __future__ import annotations

import json
import random
import re

from hybridtune.cli import main

OBEYED = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
CONTROLS = ["\x1b]0;TITLE\x07", "\x1b[2J", "\x1b[1A\x1b[2K", "\r", "\b", "\x9b31m", "\x7f", "\u202e"]


def test_an_error_line_writes_no_control_character_of_the_data(tmp_path, capsys):
    rng = random.Random()
    role = "us" + "".join(f"{c}{rng.randrange(9)}" for c in rng.sample(CONTROLS, 4)) + "er"
    rows = [{"messages": [{"role": role, "content": "x"}, {"role": "assistant", "content": "y"}]}]
    data = tmp_path / f"d{rng.randrange(99)}\x1b[2J.jsonl"
    data.write_text(json.dumps(rows[0]) + "\n")
    argv = ["data", "--dataset", str(data), "--sequence_len", "128", "--output_dir", str(tmp_path / "o")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1, err
    assert "unknown role" in line[0]
    assert not OBEYED.search(line[0]), repr(line[0])
    shown = "".join(c.encode("unicode_escape").decode("ascii") if OBEYED.match(c) else c for c in role)
    assert f"'{shown}'" in line[0], (shown, line[0])  # (shown, as escapes: the reader still sees what is wrong)
