"""The tokenisation cache (a shared datasets cache others may write into) never writes through a planted link, and
never reads an entry that is a link; the atomic write under it refuses every name someone else holds."""

from __future__ import annotations

import logging
import os

import pyarrow as pa
import pytest

from hybridtune import files
from hybridtune.data import example_cache

KEY = "ab" * 32


def _table():
    return pa.table({"input_ids": [[1, 2, 3], [4, 5]], "loss_mask": [[0, 1, 1], [1, 1]]})


@pytest.fixture
def cache(tmp_path):
    d = tmp_path / "dc" / example_cache.CACHE_SUBDIR
    d.mkdir(parents=True)
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    return d, victim


def test_a_cache_write_never_follows_a_planted_link(cache):
    """The bug this guards: the temporary `.KEY.parquet.PID.tmp` was opened by pq.write_table without O_EXCL or
    O_NOFOLLOW, so links planted for a range of pids overwrote their target (and the entry became a link to it)."""
    d, victim = cache
    path = d / f"{KEY}.parquet"
    pid = os.getpid()
    for p in range(pid - 50, pid + 50):
        os.symlink(victim, d / f".{path.name}.{p}.tmp")
    example_cache.write_cache(path, KEY, _table(), "data.jsonl", "chat")
    assert victim.read_text() == "precious"
    assert path.is_file() and not path.is_symlink()
    assert example_cache.read_cache(path, KEY)[0][1].input_ids == [4, 5]


def test_the_atomic_write_takes_another_name_when_a_link_holds_its_first(tmp_path, monkeypatch):
    """Whatever the temporary's name, a link (or any file) already there is never opened: O_EXCL | O_NOFOLLOW."""
    victim = tmp_path / "precious.txt"
    victim.write_text("precious")
    names = iter(["planted", "planted", "fresh"])
    monkeypatch.setattr(files.secrets, "token_hex", lambda n: next(names))
    os.symlink(victim, tmp_path / ".out.bin.planted.tmp")
    files.atomic_write_bytes(tmp_path / "out.bin", b"new")
    assert victim.read_text() == "precious" and (tmp_path / "out.bin").read_bytes() == b"new"
    assert (tmp_path / ".out.bin.planted.tmp").is_symlink()  # someone else's: left alone


def test_a_cache_entry_that_is_a_link_is_not_read(cache, caplog):
    """The bug this guards: an entry linked to a Parquet file elsewhere (someone else's rows) was trained on."""
    d, victim = cache
    elsewhere = d.parent / "theirs.parquet"
    example_cache.write_cache(elsewhere, KEY, _table(), "data.jsonl", "chat")  # a valid entry, under the right key
    path = d / f"{KEY}.parquet"
    os.symlink(elsewhere, path)
    with caplog.at_level(logging.WARNING):
        assert example_cache.read_cache(path, KEY) is None
    assert "symbolic link" in caplog.text
    # Tokenised again, the entry is written as a file of its own: the link is replaced, its target untouched.
    before = elsewhere.read_bytes()
    example_cache.write_cache(path, KEY, _table(), "data.jsonl", "chat")
    assert not path.is_symlink() and elsewhere.read_bytes() == before


def test_a_cache_entry_that_is_a_fifo_never_blocks(cache):
    d, _ = cache
    path = d / f"{KEY}.parquet"
    os.mkfifo(path)
    assert example_cache.read_cache(path, KEY) is None
    with pytest.raises(OSError, match="not a regular file"):
        files.open_regular(path)
