"""A run's start-up reads its data files once for their digests: the run record (`outdir.data_fingerprint`) and
the tokenisation cache key (`Source.fingerprint`) are the same digest, kept while `digests.one_read()` is open
(the trainer's output-dir and data stages); outside it nothing is kept, so an edit is never missed by a later run."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig, load_config
from hybridtune.data import digests, sources
from hybridtune.run import outdir
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg, record_run


@pytest.fixture
def digest_reads(monkeypatch):
    """Binary opens per file name (the digests read in binary; the JSON reader in text)."""
    reads: dict[str, int] = {}
    real = Path.open

    def counting(self, mode="r", *a, **k):
        if "b" in mode:
            reads[self.name] = reads.get(self.name, 0) + 1
        return real(self, mode, *a, **k)

    monkeypatch.setattr(Path, "open", counting)
    return reads


def _rows(path: Path, n: int, tag: str = "") -> None:
    path.write_text("".join(json.dumps({"text": f"row {i} {tag}"}) + "\n" for i in range(n)))


def _layouts(tmp_path: Path) -> list[str]:
    """A single file, a directory of files and a glob of files (with a hidden file the directory skips)."""
    _rows(tmp_path / "one.jsonl", 5)
    (tmp_path / "dir").mkdir()
    _rows(tmp_path / "dir" / "a.jsonl", 3)
    _rows(tmp_path / "dir" / "b.jsonl", 4)
    _rows(tmp_path / "dir" / ".hidden.jsonl", 2)
    (tmp_path / "glob").mkdir()
    _rows(tmp_path / "glob" / "x.jsonl", 2)
    _rows(tmp_path / "glob" / "y.jsonl", 6)
    return [str(tmp_path / "one.jsonl"), str(tmp_path / "dir"), str(tmp_path / "glob" / "*.jsonl")]


def test_run_record_and_cache_key_share_one_digest(tmp_path):
    """For a file, a directory and a glob, the run record's digest is the Source's fingerprint; a single file's is
    its plain sha256 (what run files have always recorded)."""
    import hashlib

    for path in _layouts(tmp_path):
        cfg = load_config(None, {"dataset": path})
        recorded = outdir.data_fingerprint(cfg)[path]
        assert sources.open_source(DatasetConfig(path=path)).fingerprint == recorded, path
    one = tmp_path / "one.jsonl"
    assert outdir.data_fingerprint(load_config(None, {"dataset": str(one)}))[str(one)] == (
        hashlib.sha256(one.read_bytes()).hexdigest()
    )


def test_one_read_reads_each_file_once_and_keeps_nothing_after(tmp_path, digest_reads):
    paths = _layouts(tmp_path)
    with digests.one_read():
        first = [digests.data_digest(*digests.local_files(p)) for p in paths]
        again = [digests.data_digest(*digests.local_files(p)) for p in paths]
    assert first == again
    assert digest_reads == {"one.jsonl": 1, "a.jsonl": 1, "b.jsonl": 1, "x.jsonl": 1, "y.jsonl": 1}
    _rows(tmp_path / "one.jsonl", 5, tag="x")  # edited in place, the same moment; outside one_read: read again
    with digests.one_read():
        edited = digests.data_digest(*digests.local_files(paths[0]))
    assert edited != first[0] and digest_reads["one.jsonl"] == 2
    assert digests._DIGESTS is None


def test_trainer_start_up_digests_its_data_once(tmp_path, small_data, digest_reads):
    """A first run reads its file twice (one digest, then the rows it tokenises); a second run over the same data hits
    the tokenisation cache and reads it once, for the one digest both its run record and the cache key take."""
    own = tmp_path / "own.jsonl"  # data no other test has tokenised: the first run here is a cache miss
    # A row of its own, of one length wherever tmp_path lies (under pytest-xdist it is longer: popen-gwN/). The path
    # itself made the row 67 tokens there, truncated at sequence_len 64, and a truncated row is named in the data
    # report, which reads the file's lines even on a cache hit (examples.Example.where): a second read.
    tag = hashlib.sha256(str(tmp_path).encode()).hexdigest()[:16]
    extra = {"messages": [{"role": "user", "content": tag}, {"role": "assistant", "content": "ok"}]}
    own.write_text(Path(small_data).read_text() + json.dumps(extra) + "\n")
    small_data, name = str(own), own.name
    for run, reads in (("first", 2), ("second", 1)):
        digest_reads.clear()
        t = Trainer(make_cfg(tmp_path / run, small_data, max_steps=1))
        try:
            t.setup()
        finally:
            t.close()
        assert digest_reads.get(name) == reads, run
        assert t.run["data"][small_data] == sources.open_source(DatasetConfig(path=small_data)).fingerprint


# --- globs whose files are one file under two names (a symlink) ---------------------------------------------------


def _plain(files, root) -> str:
    """What run files record for a glob: sha256 over name-under-root + NUL + content per file."""
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.relpath(f, root).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


@pytest.fixture
def linked(tmp_path, small_data, monkeypatch):
    """data/train.jsonl and data/test.jsonl, a symlink to it (evaluating on the training rows, say)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(open(small_data).read())
    (tmp_path / "data" / "test.jsonl").symlink_to("train.jsonl")
    return tmp_path


def test_kept_digest_of_a_glob_does_not_depend_on_what_was_hashed_first(linked):
    """Inside one_read, two globs under one root whose files are one file under two names keep their own digests:
    the names count in a glob's digest, so the kept digests must not key on the resolved path alone."""
    a, b = digests.local_files("data/train*.jsonl"), digests.local_files("data/test*.jsonl")
    alone = digests.data_digest(*b)
    assert alone == _plain(*b)
    with digests.one_read():
        digests.data_digest(*a)
        assert digests.data_digest(*b) == alone


def test_a_run_recorded_outside_one_read_over_symlinked_data_resumes(linked):
    """A run file with each glob's own digest, resumed as the trainer does (inside one_read): the data is unchanged,
    so the resume must not call it changed."""
    out = linked / "run"
    keys = dict(
        dataset=None,
        datasets=[{"path": "data/train*.jsonl"}],
        test_datasets=[{"path": "data/test*.jsonl"}],
        val_set_size=0,
    )
    cfg = make_cfg(out, None, **keys)
    old = {p: _plain(*digests.local_files(p)) for p in ("data/train*.jsonl", "data/test*.jsonl")}
    record_run(out, cfg, old)
    with digests.one_read():  # as Trainer._setup
        outdir.check_output_dir(make_cfg(out, None, resume_from_checkpoint="latest", **keys))
