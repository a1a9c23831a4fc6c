"""A tokenisation cache entry's image references (data/example_cache.py `_foreign_images`): a text model's entry holding
images, or a vision-language entry whose image source is none the rows name (a writable shared cache pointing
training at another local file), is not trusted: one warning and the data is tokenised again, never a traceback
(`eval` gave "a pack with images needs PackedCollator(vision=...)") nor a read of the planted file."""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hybridtune.cli import main
from hybridtune.config import DatasetConfig
from hybridtune.data import example_cache, examples
from hybridtune.data.sources import datasets_cache_dir
from hybridtune.models.tokenizer_files import bundled_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "vision"))
import vl_tiny  # noqa: E402


def _with_images(path: Path, source: str, grid=(1, 2, 2), tokens: int = 1) -> None:
    """The entry with row 0 given one image reference to `source`, its key and record kept."""
    table = pq.read_table(path)
    refs = [[] for _ in range(table.num_rows)]
    refs[0] = [{"source": source, "grid": list(grid), "offset": 1, "tokens": tokens, "group": -1}]
    images = pa.array(refs, table.schema.field("images").type) if "images" in table.column_names else pa.array(refs)
    rest = {n: table.column(n) for n in table.column_names if n != "images"}
    pq.write_table(pa.table({**rest, "images": images}).replace_schema_metadata(table.schema.metadata), path)


def test_a_text_models_entry_with_images_is_tokenised_again_and_eval_gives_no_traceback(tmp_path, capsys, caplog):
    n = random.randint(2, 6)
    rows = [{"messages": [{"role": "user", "content": f"{i}+{i}="}, {"role": "assistant", "content": str(2 * i)}]}
            for i in range(n)]  # fmt: skip
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    loaded = examples.load_source(DatasetConfig(path=str(data)), bundled_tokenizer())
    entry = Path(datasets_cache_dir()) / example_cache.CACHE_SUBDIR / f"{loaded.key}.parquet"
    _with_images(entry, str(tmp_path / "secret.png"))
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        again = examples.load_source(DatasetConfig(path=str(data)), bundled_tokenizer())
    assert "a model without images cannot take" in caplog.text and "tokenising again" in caplog.text
    assert not any(ex.images for ex in again.examples) and len(again.examples) == n
    _with_images(entry, str(tmp_path / "secret.png"))
    rc = main(["eval", "--model", "tiny-qwen3_5", "--dataset", str(data), "--split", "all", "--sequence_len", "64"])
    err = capsys.readouterr().err
    assert rc == 0 and "Traceback" not in err, err


def test_a_vl_entry_pointing_at_a_file_the_rows_do_not_name_is_not_trusted(tmp_path, caplog):
    tok = vl_tiny.tokenizer()
    vision = vl_tiny.vision_of(tok)
    vl_tiny.write_image(tmp_path / "a.png", 20, 12, seed=1)
    vl_tiny.write_image(tmp_path / "planted.png", 20, 12, seed=2)
    data = vl_tiny.write_rows(tmp_path / "d.jsonl", [vl_tiny.chat({"type": "image", "image": "a.png"}, "?")] * 2)
    ds = DatasetConfig(path=str(data))
    loaded = examples.load_source(ds, tok, vision=vision)
    entry = Path(datasets_cache_dir()) / example_cache.CACHE_SUBDIR / f"{loaded.key}.parquet"
    ref = loaded.examples[0].images[0]
    _with_images(entry, str(tmp_path / "planted.png"), ref.grid, ref.tokens)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        again = examples.load_source(ds, tok, vision=vision)
    assert "none of the rows names" in caplog.text, caplog.text
    assert {im.source for ex in again.examples for im in ex.images} == {str(tmp_path / "a.png")}
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hybridtune"):  # the entry written again is trusted
        assert examples.load_source(ds, tok, vision=vision).examples[0].images == again.examples[0].images
    assert "tokenising again" not in caplog.text
