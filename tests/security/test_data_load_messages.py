"""Two one-line messages about reading data that said the wrong thing (data/source_errors.py): a dataset directory
of several configs read without `name` lists its configs and names the key (it said only "Config name is
missing."), and a datasets cache that fills up while `datasets` writes its Arrow copy names the cache and the free
space (it said "cannot read as CSV ... check the file", blaming the data)."""

from __future__ import annotations

import csv
import errno
import json

import datasets

CHAT = {"messages": [{"role": "user", "content": "2+2="}, {"role": "assistant", "content": "4"}]}
README = """---
configs:
- config_name: easy
  data_files: easy/*.jsonl
- config_name: hard
  data_files: hard/*.jsonl
---
"""


def _argv(data, tmp_path) -> list[str]:
    return ["data", "--dataset", str(data), "--val_set_size", "0", "--output_dir", str(tmp_path / "out")]


def test_a_directory_of_several_configs_lists_them_and_names_the_key(tmp_path, error_line):
    repo = tmp_path / "repo"
    for config in ("easy", "hard"):
        (repo / config).mkdir(parents=True)
        (repo / config / "d.jsonl").write_text(json.dumps(CHAT) + "\n")
    (repo / "README.md").write_text(README)
    line = error_line(_argv(repo, tmp_path))
    assert line == (
        f"error: dataset directory '{repo}' has several configs (easy, hard) and none was chosen; set `name` in its "
        "`datasets` entry to one of them (eval: --dataset_name)"
    )


def test_a_full_datasets_cache_is_not_reported_as_a_bad_csv(tmp_path, monkeypatch, error_line):
    """The bug this guards: ENOSPC while datasets wrote the CSV's Arrow cache said "cannot read as CSV ([Errno 28] No
    space left on device); check the file"."""
    data = tmp_path / "d.csv"
    with data.open("w", newline="") as f:
        csv.writer(f).writerows([["messages"], [json.dumps(CHAT["messages"])]])

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(datasets.arrow_writer.ArrowWriter, "_build_writer", full)  # where the Arrow file is opened
    line = error_line(_argv(data, tmp_path))
    assert line.startswith("error: the datasets cache ")
    assert "is full ([Errno 28] No space left on device, " in line and " MiB free now)" in line
    assert f"while `datasets` wrote its Arrow copy of '{data}'; free space there, or set HF_DATASETS_CACHE" in line
    assert "check the file" not in line
