"""bench/grpo_pair's own I/O (the red team's findings of 2026-12-04): the error line of a failed run is the one that
names an error, not a progress bar; the data and reward file go to a fresh private folder, and what goes to
output_dir replaces a planted link rather than writing through it."""

from __future__ import annotations

import json

from hybridtune.bench import grpo_pair


def test_the_error_line_is_the_one_naming_an_error():
    log = "step 1\nTraceback (most recent call last):\nRuntimeError: boom\n  0%|          | 0/4 [01:32<?, ?it/s]\n"
    assert grpo_pair.last_error(log, "none") == "RuntimeError: boom"
    assert grpo_pair.last_error("just this\n", "none") == "just this"
    assert grpo_pair.last_error("", "none") == "none"


def test_written_files_replace_a_planted_link_and_never_write_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    work = tmp_path / "work"
    work.mkdir()
    for name in ("prompts.jsonl", "reward_digits.py"):
        (work / name).symlink_to(victim)
    data = grpo_pair.write_data(work, 3, 2, 4, seed=1)
    assert victim.read_text() == "keep me"
    assert not data.is_symlink() and len(data.read_text().splitlines()) == 3
    assert all("prompt" in json.loads(line) for line in data.read_text().splitlines())
    assert not (work / "reward_digits.py").is_symlink() and "def digits" in (work / "reward_digits.py").read_text()
