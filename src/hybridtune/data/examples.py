"""A data source's rows -> tokenised examples, through `Dataset.map` (in parallel with `dataset_num_proc`), cached.

A rerun or a resume of the same run reads the examples back from the tokenisation cache (data/example_cache.py:
its key, and what makes an entry trusted) instead of tokenising again. Only data that tokenised without an error is
cached, so a bad row is reported on every run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

from hybridtune.config import THREADS_PER_CPU, DatasetConfig
from hybridtune.data.example_cache import CACHE_SUBDIR, cache_key, read_cache, table_examples, write_cache
from hybridtune.data.formats import detect_type, to_example
from hybridtune.data.images import image_policy, image_source, part_reference, set_image_policy
from hybridtune.data.packing import Example
from hybridtune.data.pairs import PREFERENCE, append_rows, grouped, is_preference
from hybridtune.data.rows import decode_json_cells, used_fields
from hybridtune.data.sources import ROW_COLUMN, Source, datasets_cache_dir, open_source, quiet_datasets, where
from hybridtune.data.video import is_video_part, video_key
from hybridtune.data.vision import (
    RowImages,
    column_items,
    log_visual_tokens,
    media_digest,
    row_base,
    row_references,
)
from hybridtune.errors import DataError

logger = logging.getLogger(__name__)

# Below this many rows per process, starting processes (and copying the tokenizer into each) costs more than the
# tokenising it spreads: `dataset_num_proc: 0` (auto) gives each process at least this many rows.
ROWS_PER_PROC = 2000


@dataclasses.dataclass
class Loaded:
    """The examples of one data source, one per row in order, and where each row is (`where(i)`: 'file:LINE' or
    'file:row N'; a cache hit reads a JSON file's lines only when a row is named)."""

    examples: list[Example]
    source: Source
    key: str  # the tokenisation cache key
    fmt: str

    def where(self, i: int) -> str:
        return self.source.where(i)


def load_examples(
    ds: DatasetConfig,
    tokenizer,
    train_on_inputs: bool = False,
    num_proc: int = 0,
    cache: bool = True,
    template_kwargs: dict | None = None,
    vision=None,
) -> list[Example]:
    """All examples of one data source, tokenised with their loss masks (from the cache where it has them)."""
    return load_source(ds, tokenizer, train_on_inputs, num_proc, cache, template_kwargs, vision).examples


def load_source(
    ds: DatasetConfig,
    tokenizer,
    train_on_inputs: bool = False,
    num_proc: int = 0,
    cache: bool = True,
    template_kwargs: dict | None = None,
    vision=None,
) -> Loaded:
    """`load_examples` with where each example's row is, the cache key and the format. `template_kwargs`: the
    chat template's keyword arguments (`chat_template_kwargs`), part of the key. `vision`: a vision-language
    model's (data/vision.py), which takes the rows' images; their content and the processor are part of the key."""
    progress = sys.stderr.isatty() and os.environ.get("RANK", "0") == "0"
    src = open_source(ds, progress)
    key = cache_key(src, tokenizer, ds, train_on_inputs, template_kwargs)
    named: set[str] = set()  # the images the rows name: all a cache entry may hold (none for a text model)
    if vision is not None:
        rows = [(src.row(i), _base(src.segments, i, ds.path)) for i in range(len(src))]
        key = hashlib.sha256(f"{key}\0{media_digest(rows, vision)}".encode()).hexdigest()
        named = _named_sources(rows)
    path = Path(datasets_cache_dir()) / CACHE_SUBDIR / f"{key}.parquet"
    if cache:
        cached = read_cache(path, key, len(tokenizer), named)
        if cached is not None:
            examples, fmt = cached
            logger.info(
                "dataset %s: tokenised data from cache %s (%d examples, format '%s')", ds.path, path, len(examples), fmt
            )
            log_visual_tokens(ds.path, examples)
            return Loaded(grouped(examples) if fmt == PREFERENCE else examples, src, key, fmt)
    if len(src) == 0:
        raise DataError(f"dataset file '{ds.path}' has no rows; give a file with at least one example")
    fmt = ds.type
    if fmt == "auto":
        fmt = PREFERENCE if is_preference(src.row(0), ds) else detect_type(src.row(0), ds, src.where(0))
        logger.info("dataset %s: detected format '%s'", ds.path, fmt)
    t0 = time.perf_counter()
    procs = resolve_num_proc(num_proc, len(src))
    table = _tokenise(src, tokenizer, ds, train_on_inputs, fmt, procs, key, progress, template_kwargs, vision)
    _check(src, table, ds, fmt, train_on_inputs)
    _warn_unused(table, ds, fmt)
    table = table.select(["input_ids", "loss_mask", "images"])
    examples = table_examples(table)
    logger.info(
        "dataset %s: tokenised %d examples in %.1f s (%d process%s)",
        ds.path,
        len(examples),
        time.perf_counter() - t0,
        procs,
        "" if procs == 1 else "es",
    )
    log_visual_tokens(ds.path, examples)
    if cache:
        write_cache(path, key, table, ds.path, fmt)
    return Loaded(grouped(examples) if fmt == PREFERENCE else examples, src, key, fmt)


def _base(segments, i: int, data_path: str, starts=None) -> Path:
    """The folder a row's relative image paths are taken from and its images are confined to (data/images.py): its
    data file's, the data directory, or for a dataset id the working directory."""
    return row_base(segments, i, data_path, starts) or Path.cwd()


def _named_sources(rows) -> set[str]:
    """The sources (as `ImageRef.source` holds them) of every image and video the rows name, as tokenising resolves
    them; a reference that would be refused names nothing."""
    named = set()
    for row, base in rows:
        row = decode_json_cells(row, tuple(row)) if isinstance(row, dict) else row  # (a CSV cell's JSON text)
        column = column_items(row.get("images")) if isinstance(row, dict) else None
        for part in [*row_references(row), *({"type": "image", "image": p} for p in column or ())]:
            try:
                if is_video_part(part):
                    named.add(video_key(part, base, "", ""))
                else:
                    named.add(image_source(part_reference(part, "", ""), base, "", ""))
            except DataError:
                continue
    return named


def resolve_num_proc(num_proc: int, rows: int) -> int:
    """`dataset_num_proc`: as given (at most one per row and THREADS_PER_CPU per core, said), or 0 = auto: this
    process's share of the cores (a torchrun job's processes on this host share them), each with at least
    ROWS_PER_PROC rows."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    if num_proc > 0:
        most = THREADS_PER_CPU * cores  # (a config from a larger machine: each process holds a tokenizer, for nothing)
        if num_proc > most:
            logger.warning(
                "dataset_num_proc %d: %d processes instead, %d per core of this machine",
                num_proc,
                most,
                THREADS_PER_CPU,
            )
        return max(1, min(num_proc, most, rows))
    cores //= max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, min(cores, rows // ROWS_PER_PROC))


def _features():
    import datasets

    return datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "loss_mask": datasets.List(datasets.Value("int8")),
            "roles": datasets.List(datasets.Value("string")),
            "unused": datasets.List(datasets.Value("string")),
            "error": datasets.Value("string"),
            "images": datasets.List(
                {
                    "source": datasets.Value("string"),
                    "grid": datasets.List(datasets.Value("int32")),
                    "offset": datasets.Value("int32"),
                    "tokens": datasets.Value("int32"),
                    "group": datasets.Value("int32"),
                }
            ),
        }
    )


def _tokenise_batch(
    batch: dict,
    indices: list[int],
    *,
    tokenizer,
    ds,
    train_on_inputs,
    fmt,
    segments,
    json_rows,
    template_kwargs,
    vision,
    policy,
) -> dict[str, list]:
    """Dataset.map's function: a batch of rows -> ids, masks, the chat roles seen, the fields the format does not
    read, and each row's error (a bad row does not stop the map; the first one by position is raised afterwards,
    whatever the process order). `policy`: the parent's image policy (a spawned worker starts without it)."""
    set_image_policy(policy.allow_outside, policy.roots)
    if json_rows:
        rows = [json.loads(t) for t in batch[ROW_COLUMN]]
    else:
        rows = [dict(zip(batch, values)) for values in zip(*batch.values())]
    starts = [s.start for s in segments]
    out: dict[str, list] = {"input_ids": [], "loss_mask": [], "roles": [], "unused": [], "error": [], "images": []}
    for i, row in zip(indices, rows):
        if fmt == PREFERENCE:  # two documents a row: prompt + chosen, prompt + rejected (data/pairs.py)
            append_rows(out, row, tokenizer, ds, where(segments, i, starts), template_kwargs)
            continue
        roles: set[str] = set()
        read = used_fields(fmt, ds, row) | ({"images"} if vision is not None else set())  # (LLaVA-style rows')
        out["unused"].append(sorted(set(row) - read))
        try:
            at = where(segments, i, starts)
            images = RowImages(vision, _base(segments, i, ds.path, starts)) if vision is not None else None
            ex = to_example(row, fmt, tokenizer, ds, train_on_inputs, at, roles, template_kwargs, images)
        except DataError as e:
            out["input_ids"].append([])
            out["loss_mask"].append([])
            out["roles"].append([])
            out["error"].append(str(e))
            out["images"].append([])
            continue
        out["images"].append([{**dataclasses.asdict(r), "grid": list(r.grid)} for r in ex.images])
        out["input_ids"].append(ex.input_ids)
        out["loss_mask"].append(ex.loss_mask)
        out["roles"].append(sorted(roles))
        out["error"].append(None)
    out["images"] += [[]] * (len(out["input_ids"]) - len(out["images"]))  # rows appended without images
    return out


def _tokenise(
    src: Source,
    tokenizer,
    ds,
    train_on_inputs: bool,
    fmt: str,
    procs: int,
    key: str,
    progress: bool,
    template_kwargs,
    vision=None,
):
    """The pyarrow table of input_ids, loss_mask, roles, unused, error: one row per source row, in order."""
    kwargs = {
        "tokenizer": tokenizer,
        "ds": ds,
        "train_on_inputs": train_on_inputs,
        "fmt": fmt,
        "segments": src.segments,
        "json_rows": src.json_rows,
        "template_kwargs": template_kwargs,
        "vision": vision,
        "policy": image_policy(),
    }
    with quiet_datasets(progress):
        mapped = src.dataset.map(
            _tokenise_batch,
            batched=True,
            batch_size=256,
            with_indices=True,
            num_proc=procs if procs > 1 else None,
            remove_columns=src.dataset.column_names,
            features=_features(),
            fn_kwargs=kwargs,
            keep_in_memory=True,  # the result goes into our own cache; no second copy in the datasets cache
            load_from_cache_file=False,
            new_fingerprint=key[:40],  # datasets adds a shard suffix; 64 characters at most
            desc=f"tokenising {src.name}",
        )
    return mapped.with_format("arrow")[:]


def _check(src: Source, table, ds: DatasetConfig, fmt: str, train_on_inputs: bool) -> None:
    """The first bad row's error; for chats, roles_to_train must name a role that occurs in the data."""
    import pyarrow.compute as pc

    errors = table.column("error")
    if errors.null_count < len(errors):
        first = pc.index(pc.is_valid(errors), True).as_py()
        raise DataError(errors[first].as_py())
    if fmt in ("chat", "sharegpt") and not train_on_inputs:
        seen = set(pc.unique(pc.list_flatten(table.column("roles"))).to_pylist())
        if not seen & set(ds.roles_to_train):
            mapped = " (sharegpt roles are mapped: human -> user, gpt -> assistant)" if fmt == "sharegpt" else ""
            raise DataError(
                f"dataset file '{ds.path}': roles_to_train {ds.roles_to_train} names no role that occurs in its "
                f"messages (roles: {', '.join(sorted(seen))}){mapped}, so nothing would be trained on; set "
                "roles_to_train to roles of the data (e.g. [assistant])"
            )


def _warn_unused(table, ds: DatasetConfig, fmt: str) -> None:
    """One warning listing the fields of the data that its format does not read (an alpaca `system` column, an
    `id`): they are not trained on."""
    import pyarrow.compute as pc

    unused = sorted(pc.unique(pc.list_flatten(table.column("unused"))).to_pylist())
    if unused:
        logger.warning(
            "dataset %s: field%s %s not read by format '%s' (not trained on); map %s with the field_* keys or drop %s",
            ds.path,
            "" if len(unused) == 1 else "s",
            ", ".join(repr(u) for u in unused),
            fmt,
            "it" if len(unused) == 1 else "them",
            "it" if len(unused) == 1 else "them",
        )
