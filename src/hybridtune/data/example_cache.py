"""The tokenisation cache: one Parquet file of tokenised examples per (data, tokenizer, settings), trusted only when
it is what tokenising gives.

Its name is the sha256 of the data's content (`Source.fingerprint`), the tokenizer (its tokenizer.json, chat template
and special tokens), the dataset entry's keys bar its path, train_on_inputs, and the source of the data package (a
change to how rows are rendered is a new key): `cache_key`. It lives in the datasets cache (HF_DATASETS_CACHE, else
HF_HOME/datasets) under hybridtune-tokenised/; deleting it is always safe. An entry is read only when it is a regular
file, and trusted only when its ids, masks and row counts are what tokenising gives (`_mismatch`), and its image
references none for a text model and, for a vision-language one, only images the rows name now (`_foreign_images`: a
planted entry cannot point training at another file). It is written atomically, never through a planted link.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from hybridtune.config import DatasetConfig
from hybridtune.data.packing import Example
from hybridtune.data.sources import Source
from hybridtune.data.vision import ImageRef
from hybridtune.files import atomic_write, open_regular

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "hybridtune-tokenised"
CACHE_FORMAT = 2  # bump when the cached file's layout changes
_CODE_DIR = Path(__file__).resolve().parent


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of what tokenising depends on: the tokenizer's own definition, its chat template, special tokens."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    extra = [
        type(tokenizer).__name__,
        tokenizer.chat_template,
        tokenizer.special_tokens_map,
        getattr(tokenizer, "add_bos_token", None),
        getattr(tokenizer, "add_eos_token", None),
    ]
    h.update(json.dumps(extra, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _code_fingerprint() -> str:
    h = hashlib.sha256()
    for f in sorted(_CODE_DIR.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def cache_key(
    src: Source, tokenizer, ds: DatasetConfig, train_on_inputs: bool, template_kwargs: dict | None = None
) -> str:
    """What the examples of `src` are a function of (its `type: auto` resolves the same way for the same data)."""
    settings = {k: v for k, v in dataclasses.asdict(ds).items() if k != "path"}
    parts = [
        f"format {CACHE_FORMAT}",
        src.fingerprint,
        tokenizer_fingerprint(tokenizer),
        json.dumps(settings, sort_keys=True),
        f"train_on_inputs={train_on_inputs}",
        _code_fingerprint(),
    ]
    if template_kwargs:  # (none: the key an older release wrote for the same data)
        parts.append(json.dumps(template_kwargs, sort_keys=True))
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _lists(column) -> list[list[int]]:
    """A list<int> column as Python lists, through one flat conversion (several times faster than to_pylist)."""
    if column.num_chunks == 0:
        return []
    array = column.combine_chunks()
    offsets = array.offsets.to_numpy().tolist()
    flat = array.values.to_numpy().tolist()
    return [flat[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def table_examples(table) -> list[Example]:
    import pyarrow.compute as pc

    ids, masks = _lists(table.column("input_ids")), _lists(table.column("loss_mask"))
    column = table.column("images") if "images" in table.column_names else None
    if column is None or not pc.sum(pc.list_value_length(column)).as_py():
        return [Example(i, m) for i, m in zip(ids, masks)]
    refs = [
        tuple(ImageRef(r["source"], tuple(r["grid"]), r["offset"], r["tokens"], r["group"]) for r in row)
        for row in column.to_pylist()
    ]
    return [Example(i, m, r) for i, m, r in zip(ids, masks, refs)]


def read_cache(
    path: Path, key: str, vocab_size: int | None = None, named: set[str] = frozenset()
) -> tuple[list[Example], str] | None:
    """The cached examples and their format, or None (absent, unreadable, a link, or not what tokenising gives:
    then tokenised again and replaced). An entry is read only when it is a regular file (never through a link
    someone planted), and trusted only when its rows pass `_mismatch` (ids below `vocab_size`, the tokenizer's) and
    its images are among `named` (`_foreign_images`)."""
    import pyarrow.parquet as pq

    if path.is_symlink():
        logger.warning("tokenised data cache %s is a symbolic link, not hybridtune's file; tokenising again", path)
        return None
    if not path.is_file():
        return None
    try:
        with open_regular(path) as f:
            table = pq.read_table(f)
        meta = table.schema.metadata or {}
        if meta.get(b"hybridtune_key") != key.encode():
            raise ValueError("its key does not match its name")
        why = _mismatch(table, vocab_size, meta.get(b"hybridtune_rows")) or _foreign_images(table, named)
        if why is None:
            return table_examples(table), meta.get(b"hybridtune_format", b"?").decode()
    except Exception as e:  # a truncated or foreign file
        logger.warning("tokenised data cache %s is unreadable (%s); tokenising again", path, e)
        return None
    logger.warning("tokenised data cache %s is not what tokenising gives (%s); tokenising again", path, why)
    return None


def _mismatch(table, vocab_size: int | None, recorded: bytes | None) -> str | None:
    """Why a cached table cannot be what tokenising wrote, or None: its row count against the count written with
    it, a row without ids or mask, a loss mask whose length is not its ids', a mask value other than 0 and 1, an id
    outside the vocabulary. Vectorised over the Arrow columns (a pass over the tokens in C)."""
    import pyarrow.compute as pc

    if recorded is None or not recorded.isdigit() or int(recorded) != table.num_rows:
        said = f"{int(recorded):,}" if recorded and recorded.isdigit() else "no count"
        return f"it holds {table.num_rows:,} rows where its record says {said}"
    ids, mask = table.column("input_ids"), table.column("loss_mask")
    flat_ids, flat_mask = pc.list_flatten(ids), pc.list_flatten(mask)
    if ids.null_count or mask.null_count or flat_ids.null_count or flat_mask.null_count:
        return "it holds null ids or mask entries"
    n_ids, n_mask = pc.list_value_length(ids), pc.list_value_length(mask)
    differ = pc.not_equal(n_ids, n_mask)
    if pc.any(differ).as_py():
        row = pc.index(differ, True).as_py()
        return f"row {row + 1} has {n_mask[row].as_py()} loss-mask entries for {n_ids[row].as_py()} ids"
    if len(flat_mask):
        low, high = pc.min_max(flat_mask).values()
        if low.as_py() < 0 or high.as_py() > 1:
            return f"loss-mask values from {low.as_py()} to {high.as_py()}, not 0 and 1"
    if len(flat_ids):
        low, high = (v.as_py() for v in pc.min_max(flat_ids).values())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            return f"ids from {low:,} to {high:,}, outside the tokenizer's vocabulary of {vocab_size:,}"
    return None


def _foreign_images(table, named: set[str]) -> str | None:
    """Why a cached table's image references cannot be this data's, or None: any for a text model (`named` empty
    and no images in the rows), or a source that none of the rows names."""
    import pyarrow.compute as pc

    if "images" not in table.column_names or not pc.sum(pc.list_value_length(table.column("images"))).as_py():
        return None
    for k, row in enumerate(table.column("images").to_pylist()):
        for ref in row or ():
            source = ref.get("source") if isinstance(ref, dict) else None
            if source not in named:
                shown = str(source)[:80]
                return f"row {k + 1} refers to image {shown!r}, which " + (
                    "none of the rows names" if named else "a model without images cannot take"
                )
    return None


def write_cache(path: Path, key: str, table: Any, source: str, fmt: str) -> None:
    """Write atomically through a new temporary (`files.atomic_write`: O_EXCL | O_NOFOLLOW, a random name, so a
    link planted in a shared cache is never written through); a cache that cannot be written is only a warning."""
    import pyarrow.parquet as pq

    meta = {b"hybridtune_key": key.encode(), b"hybridtune_source": source.encode(), b"hybridtune_format": fmt.encode()}
    meta[b"hybridtune_rows"] = str(table.num_rows).encode()  # checked on reading (`_mismatch`)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: pq.write_table(table.replace_schema_metadata(meta), f))
    except OSError as e:
        logger.warning("could not cache the tokenised data in %s (%s); the next run tokenises again", path, e)
