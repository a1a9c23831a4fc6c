"""`--dataset csv` (json, parquet, text, ...: the names of datasets' packaged loaders) with no such local file is
refused in one line (data/sources.py), instead of reading every file of that kind under the working directory as
the dataset (a stray private_notes.csv in a subfolder was evaluated and trained on)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data.sources import open_source
from hybridtune.errors import DataError


def _plant(where, kind: str) -> None:
    """A file of `kind` in a subfolder of the working directory, with rows the data path would take."""
    sub = where / "sub"
    sub.mkdir()
    rows = [{"text": f"private note {i}"} for i in range(40)]
    if kind == "csv":
        (sub / "private_notes.csv").write_text("text\n" + "".join(r["text"] + "\n" for r in rows))
    elif kind == "json":
        (sub / "private_notes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), sub / "private_notes.parquet")
    else:
        (sub / "private_notes.txt").write_text("".join(r["text"] + "\n" for r in rows))


@pytest.mark.parametrize("kind", ["csv", "json", "parquet", "text"])
def test_a_loader_name_is_refused_and_nothing_under_the_working_directory_is_read(
    tmp_path, monkeypatch, kind, error_line
):
    """The bug this guards: `hybridtune data --dataset csv` said "dataset csv[train]: 40 rows" (rc 0)."""
    _plant(tmp_path, kind)
    monkeypatch.chdir(tmp_path)
    argv = ["data", "--dataset", kind, "--dataset_type", "text", "--val_set_size", "0", "--output_dir", "out"]
    line = error_line(argv)
    assert f"dataset '{kind}' is not a local file" in line
    assert f"the `datasets` library's {kind} loader, which would read every {kind} file under the working" in line
    assert "give the data file's path" in line


def test_a_local_file_of_that_name_and_a_hub_id_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "text").write_text("a file named like a loader\n")
    with pytest.raises(DataError, match="unsupported file type"):  # the file itself, not the loader
        open_source(DatasetConfig(path="text"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="not in the datasets cache"):  # an org/name id still goes to the hub
        open_source(DatasetConfig(path="someorg/csv"))
