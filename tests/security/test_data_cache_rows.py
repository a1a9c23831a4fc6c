"""A tokenisation cache entry is trusted only when its rows can be what tokenising wrote (data/example_cache.py
`_mismatch`): ids inside the tokenizer's vocabulary, a loss mask as long as its ids with values 0 and 1, and the row
count written with it. Otherwise one warning and the data is tokenised again (and the entry replaced), instead of an
IndexError traceback in the embedding (a device assert on a GPU) or a wrong diagnosis that blames the data."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data import example_cache, examples
from hybridtune.data.sources import datasets_cache_dir
from hybridtune.models.tokenizer_files import bundled_tokenizer

ROWS = [
    {"messages": [{"role": "user", "content": f"{i}+{i}="}, {"role": "assistant", "content": str(2 * i)}]}
    for i in range(6)
]


@pytest.fixture
def cached(tmp_path):
    """(dataset entry, its cache file, the examples as tokenised): the entry written by a first load."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    ds = DatasetConfig(path=str(data))
    loaded = examples.load_source(ds, bundled_tokenizer())
    path = Path(datasets_cache_dir()) / example_cache.CACHE_SUBDIR / f"{loaded.key}.parquet"
    assert path.is_file()
    return ds, path, loaded.examples


def _rewrite(path: Path, change) -> None:
    """The entry with its rows changed by `change(input_ids, loss_mask)`, its key and record kept."""
    table = pq.read_table(path)
    ids, mask = table.column("input_ids").to_pylist(), table.column("loss_mask").to_pylist()
    ids, mask = change(ids, mask)
    columns = {"input_ids": pa.array(ids, pa.list_(pa.int32())), "loss_mask": pa.array(mask, pa.list_(pa.int8()))}
    rest = {n: table.column(n).slice(0, len(ids)) for n in table.column_names if n not in columns}
    pq.write_table(pa.table({**columns, **rest}).replace_schema_metadata(table.schema.metadata), path)


def _out_of_vocab(ids, mask):
    ids[2][3] = len(bundled_tokenizer()) + 1000
    return ids, mask


def _short_mask(ids, mask):
    mask[4] = mask[4][:-3]
    return ids, mask


def _one_row_fewer(ids, mask):
    return ids[:-1], mask[:-1]


def _mask_values(ids, mask):
    mask[0][0] = 7
    return ids, mask


@pytest.mark.parametrize(
    "change, said",
    [
        (_out_of_vocab, "outside the tokenizer's vocabulary of"),
        (_short_mask, "row 5 has"),
        (_one_row_fewer, "it holds 5 rows where its record says 6"),
        (_mask_values, "loss-mask values from 0 to 7"),
    ],
)
def test_a_tampered_entry_is_tokenised_again_with_one_warning(cached, caplog, change, said):
    """The bug this guards: `read_cache` checked the key only, and returned these rows to the trainer."""
    ds, path, fresh = cached
    _rewrite(path, change)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        again = examples.load_source(ds, bundled_tokenizer())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "is not what tokenising gives" in warnings[0] and said in warnings[0], warnings
    assert again.examples == fresh
    # The entry was replaced by the tokenised rows: the next load reads it back without a word.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        assert examples.load_source(ds, bundled_tokenizer()).examples == fresh
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_an_intact_entry_is_read_back(cached, caplog):
    ds, path, fresh = cached
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        assert examples.load_source(ds, bundled_tokenizer()).examples == fresh
    assert "tokenised data from cache" in caplog.text
