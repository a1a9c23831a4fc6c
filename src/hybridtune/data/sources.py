"""Where the rows of a data source come from, through the `datasets` library.

A `path` is, in this order: bundled data (`hybridtune:sample/<file>`); a local file (.jsonl/.ndjson, .json holding
an array of objects or one object per line, .csv/.tsv, .parquet, .arrow); a local directory (saved with
`Dataset.save_to_disk`, or a dataset repository: data files, optionally a README.md naming configs and splits); a
glob of files of one kind; else a dataset id (`org/name`) loaded with `split` and `name` (the config) from the
datasets cache, downloading only where downloads are allowed (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE honoured).

JSON and JSONL are read here, not by pyarrow: rows may differ in their fields' types (a bad row must be reported,
not break the whole table), and a bad row is named by its line. They become a one-column dataset of each row's
JSON text. Every other kind is the `datasets` table itself, its rows named `file:row N`.
"""

from __future__ import annotations

import bisect
import codecs
import contextlib
import csv
import glob
import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtune.config import DatasetConfig
from hybridtune.data.digests import data_digest, local_files, sha256_files, visible_files
from hybridtune.data.images import undecoded_images
from hybridtune.data.source_errors import (
    innermost,
    raise_if_config_missing,
    raise_if_disk_full,
    refuse_builder_name,
    short,
)
from hybridtune.errors import DataError
from hybridtune.textfile import not_a_file, nul_error, utf8_error

logger = logging.getLogger(__name__)

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
ROW_COLUMN = "_hybridtune_json_row"  # JSON files: each row's JSON text
# File suffix -> the `datasets` builder that reads it (json: read here).
KINDS = {
    ".jsonl": "json",
    ".ndjson": "json",
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
KIND_NAMES = {"json": "JSON", "csv": "CSV", "parquet": "Parquet", "arrow": "Arrow"}
ACCEPTED = "a JSONL, JSON, CSV, Parquet or Arrow file, a dataset directory, a glob, or a dataset id (org/name)"
_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass
class Segment:
    """The rows from `start` on come from `label`: at file lines `lines` (JSON files) or as its rows numbered from 1"""

    start: int
    label: str
    lines: list[int] | None = None


class Source:
    """The rows of one data source: `dataset` (a `datasets.Dataset`; JSON files: one column ROW_COLUMN of JSON text),
    where each row is (`where`), and `fingerprint`: what the rows are (content hashes, or the datasets cache's own
    fingerprint for a dataset id). JSON files are read on first use of the rows: a cache hit needs only the
    fingerprint."""

    def __init__(
        self,
        name: str,
        dataset: Any,
        segments: list[Segment],
        fingerprint: str,
        json_rows: bool = False,
        loader: Callable[[], tuple[Any, list[Segment]]] | None = None,
    ) -> None:
        self.name, self.fingerprint, self.json_rows = name, fingerprint, json_rows
        self._dataset, self._segments, self._loader = undecoded_images(dataset), segments, loader
        self._starts = [s.start for s in segments]

    def _load(self) -> None:
        if self._loader is not None:
            dataset, self._segments = self._loader()
            self._dataset = undecoded_images(dataset)
            self._starts = [s.start for s in self._segments]
            self._loader = None

    @property
    def dataset(self) -> Any:
        self._load()
        return self._dataset

    @property
    def segments(self) -> list[Segment]:
        self._load()
        return self._segments

    def __len__(self) -> int:
        return len(self.dataset)

    def where(self, i: int) -> str:
        return where(self.segments, i, self._starts)

    def row(self, i: int) -> dict:
        r = self.dataset[i]
        return json.loads(r[ROW_COLUMN]) if self.json_rows else r

    def rows(self) -> Iterator[tuple[str, dict]]:
        for i in range(len(self)):
            yield self.where(i), self.row(i)


def where(segments: list[Segment], i: int, starts: list[int] | None = None) -> str:
    """'file:LINE' (JSON files) or 'file:row N' for row `i` of a source made of `segments` (starting at `starts`)."""
    s = segments[bisect.bisect_right(starts or [s.start for s in segments], i) - 1]
    return f"{s.label}:{s.lines[i - s.start]}" if s.lines is not None else f"{s.label}:row {i - s.start + 1}"


def datasets_cache_dir() -> str:
    """The datasets cache (HF_DATASETS_CACHE, else HF_HOME/datasets), read when it is used."""
    import datasets

    return os.environ.get("HF_DATASETS_CACHE") or str(datasets.config.HF_DATASETS_CACHE)


def offline() -> bool:
    import datasets

    on = ("1", "ON", "YES", "TRUE")
    env = [os.environ.get(k, "").upper() for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")]
    return bool(datasets.config.HF_HUB_OFFLINE) or any(v in on for v in env)


@contextlib.contextmanager
def quiet_datasets(progress: bool):
    """datasets' own warnings and error lines off (we say what happened, in one line), its progress bars on only
    when asked (a terminal)."""
    import datasets
    from datasets.utils import logging as dlog

    bars_were_off, verbosity = datasets.are_progress_bars_disabled(), dlog.get_verbosity()
    (datasets.enable_progress_bars if progress else datasets.disable_progress_bars)()
    dlog.set_verbosity(dlog.CRITICAL)
    try:
        yield
    finally:
        (datasets.disable_progress_bars if bars_were_off else datasets.enable_progress_bars)()
        dlog.set_verbosity(verbosity)


def open_source(ds: DatasetConfig, progress: bool = False) -> Source:
    """The rows of `ds.path`; a path that names nothing readable is one DataError saying what to give."""
    path = ds.path
    if path.startswith("hybridtune:"):
        rel = path.split(":", 1)[1]
        if not rel.startswith("sample/"):
            raise DataError(f"bundled data path '{path}' must look like 'hybridtune:sample/<file>'")
        p = SAMPLE_DIR / rel[len("sample/") :]
        if not p.is_file():
            raise DataError(f"bundled data '{path}' does not exist; see {SAMPLE_DIR} for the bundled files")
        return _from_files([p], path, progress)
    p = Path(path).expanduser()
    with quiet_datasets(progress):
        if p.is_file():
            return _from_files([p], path, progress)
        if p.is_dir():
            return _from_dir(p, ds)
        if glob.has_magic(path):
            files, root = local_files(path)
            if not files:
                raise DataError(
                    f"dataset glob '{path}' matches no file; check the pattern in `datasets` or `--dataset`"
                )
            return _from_files(files, path, progress, root)
        if _ID.match(path) and Path(path).suffix.lower() not in KINDS:
            refuse_builder_name(path)
            return _from_hub(path, ds)
    it = not_a_file(p) or "does not exist"
    raise DataError(f"dataset file '{path}' {it}; check the path in `datasets` or `--dataset`")


def read_rows(path: str, split: str = "train", name: str | None = None) -> Iterator[tuple[str, dict]]:
    """(location, row) for every row of a source: location is 'file:line' (JSON files) or 'file:row N'."""
    yield from open_source(DatasetConfig(path=path, split=split, name=name)).rows()


# --- local files -----------------------------------------------------------------------------------------------


def _kind(p: Path) -> str:
    kind = KINDS.get(p.suffix.lower())
    if kind is None:
        raise DataError(f"{p}: unsupported file type '{p.suffix}'; give {ACCEPTED}")
    return kind


def _from_files(files: list[Path], name: str, progress: bool, root: Path | None = None) -> Source:
    kinds = {_kind(f) for f in files}
    if len(kinds) > 1:
        raise DataError(f"dataset '{name}' mixes file types ({', '.join(sorted(kinds))}); give files of one type")
    (kind,) = kinds
    fingerprint = data_digest(files, root)
    single = len(files) == 1
    segments = []
    if kind == "json":

        def load() -> tuple[Any, list[Segment]]:
            import datasets

            texts: list[str] = []
            for f in files:
                rows, lines = read_json_file(f)
                segments.append(Segment(len(texts), str(f), lines))
                texts.extend(rows)
            return datasets.Dataset.from_dict({ROW_COLUMN: texts}), segments

        return Source(name, None, [], fingerprint, json_rows=True, loader=load)
    parts = []
    with quiet_datasets(progress):
        for f in files:
            parts.append(_load_file(f, kind))
            segments.append(Segment(sum(len(d) for d in parts[:-1]), str(f)))
    if single:
        return Source(name, parts[0], segments, fingerprint)
    import datasets

    try:
        table = datasets.concatenate_datasets(parts)
    except ValueError as e:  # the files' columns differ
        raise DataError(
            f"dataset '{name}': its files cannot be joined ({short(e)}); give files with the same columns"
        ) from None
    return Source(name, table, segments, fingerprint)


def _load_file(f: Path, kind: str):
    import datasets

    kwargs: dict[str, Any] = {}
    if kind == "csv":
        # Every cell is text (a column of digits stays its digits); only an empty cell is missing (null), so a
        # cell saying "NA" or "null" stays that text.
        sep = "\t" if f.suffix.lower() == ".tsv" else ","
        kwargs = {"sep": sep, "keep_default_na": False, "na_values": [""]}
        with f.open(newline="", encoding="utf-8-sig", errors="replace") as fh:
            header = next(csv.reader(fh, delimiter=sep), [])
        header = [c or f"Unnamed: {i}" for i, c in enumerate(header)]  # pandas' name for a column without one
        if header and len(set(header)) == len(header):
            kwargs["features"] = datasets.Features({c: datasets.Value("string") for c in header})
    try:
        return datasets.load_dataset(kind, data_files=str(f), split="train", cache_dir=datasets_cache_dir(), **kwargs)
    except Exception as e:  # pyarrow, pandas and datasets raise many types for a file they cannot read
        raise_if_disk_full(e, f"'{f}'", datasets_cache_dir())
        if kind == "csv" and isinstance(innermost(e), UnicodeDecodeError):
            raw = f.read_bytes()  # the decoder's position is inside a block pandas read: find the line
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise DataError(f"{f}:{utf8_error(raw, bad)}; save the file as UTF-8 text") from None
        raise DataError(f"{f}: cannot read as {KIND_NAMES[kind]} ({short(e)}); check the file") from None


def read_json_file(p: Path) -> tuple[list[str], list[int]]:
    """The rows of a JSON file, as JSON text each, and the line each starts on: a JSON array of objects, or one
    object per line (JSONL; blank lines skipped). Bytes that are not UTF-8, a NUL, malformed JSON or a row that is
    not an object name the line (and column)."""
    raw_lines = p.read_bytes().splitlines(keepends=True)
    lines = []
    for lineno, raw in enumerate(raw_lines, 1):
        if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
            raw = raw[len(codecs.BOM_UTF8) :]  # editors on Windows write one; it is not part of the JSON
        lines.append(_decode_line(raw, p, lineno))
    first = next((ln.lstrip()[:1] for ln in lines if ln.strip()), "")
    if first == "[":
        return _json_array("".join(lines), p)
    rows, starts = [], []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        text = line.rstrip("\r\n")  # so that an error at the end has this line's column
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            hint = "fix or remove the line"
            if lineno == 1 and first == "{" and len(lines) > 1:
                hint += " (a JSON file holds an array of objects or one object per line)"
            raise DataError(f"{p}:{lineno}: malformed JSON ({e.msg} at column {e.colno}); {hint}") from None
        if not isinstance(row, dict):
            raise DataError(f"{p}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
        rows.append(text)
        starts.append(lineno)
    return rows, starts


def _json_array(text: str, p: Path) -> tuple[list[str], list[int]]:
    """The objects of a JSON array, each as its JSON text with the line it starts on."""
    decoder = json.JSONDecoder()
    rows, starts = [], []
    ws = re.compile(r"\s*")
    i = ws.match(text, 0).end() + 1  # past '['
    line, counted = 1, 0

    def fail(msg: str, at: int) -> DataError:
        ln = text.count("\n", 0, at) + 1
        col = at - (text.rfind("\n", 0, at) + 1) + 1
        return DataError(f"{p}:{ln}: malformed JSON ({msg} at column {col}); fix the file")

    i = ws.match(text, i).end()
    if text[i : i + 1] == "]":
        return [], []
    while True:
        try:
            row, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{e.lineno}: malformed JSON ({e.msg} at column {e.colno}); fix the file") from None
        line += text.count("\n", counted, i)
        counted = i
        if not isinstance(row, dict):
            raise DataError(
                f"{p}:{line}: item {len(rows) + 1} of the JSON array is not an object; give one object per row"
            )
        rows.append(text[i:end])
        starts.append(line)
        i = ws.match(text, end).end()
        if text[i : i + 1] == "]":
            if text[ws.match(text, i + 1).end() :]:
                raise fail("Extra data after the array", ws.match(text, i + 1).end())
            return rows, starts
        if text[i : i + 1] != ",":
            raise fail("Expecting ',' delimiter", i)
        i = ws.match(text, i + 1).end()


def _decode_line(raw: bytes, p: Path, lineno: int) -> str:
    """One line as text; bytes that are not UTF-8 (or a NUL: a binary file) name the line and column."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}:{utf8_error(raw, e, lineno)}; save the file as UTF-8 JSONL (a compressed or binary file is not JSONL)"
        ) from None
    nul = nul_error(line, "JSONL text", lineno)
    if nul:
        raise DataError(f"{p}:{nul}") from None
    return line


# --- directories and dataset ids ---------------------------------------------------------------------------------


def _pick_split(d, split: str, name: str):
    import datasets

    if isinstance(d, datasets.DatasetDict):
        if split not in d:
            raise DataError(f"dataset '{name}' has no split '{split}' (splits: {', '.join(d)}); set `split`")
        return d[split]
    return d


def _from_dir(p: Path, ds: DatasetConfig) -> Source:
    import datasets

    files = visible_files(p)
    label = f"{ds.path}[{ds.split}]"
    if (p / "state.json").is_file() or (p / "dataset_dict.json").is_file():  # Dataset(Dict).save_to_disk
        try:
            d = datasets.load_from_disk(str(p))
        except Exception as e:
            raise DataError(f"dataset directory '{ds.path}' cannot be loaded ({short(e)}); save it again") from None
        d = _pick_split(d, ds.split, ds.path)
        if not (p / "dataset_dict.json").is_file():
            label = ds.path
        return Source(ds.path, d, [Segment(0, label)], sha256_files(files, p))
    if not any(f.suffix.lower() in KINDS or f.suffix.lower() == ".txt" for f in files):
        raise DataError(
            f"dataset path '{ds.path}' is a directory without data files (.jsonl, .json, .csv, .parquet, .arrow) and "
            f"not saved with save_to_disk; give {ACCEPTED}"
        )
    try:
        d = datasets.load_dataset(str(p), name=ds.name, split=ds.split, cache_dir=datasets_cache_dir())
    except Exception as e:
        raise_if_disk_full(e, f"directory '{ds.path}'", datasets_cache_dir())
        raise_if_config_missing(e, f"dataset directory '{ds.path}'")
        raise DataError(f"dataset directory '{ds.path}' (split '{ds.split}') cannot be loaded ({short(e)})") from None
    return Source(ds.path, d, [Segment(0, label)], sha256_files(files, p))


def _from_hub(repo_id: str, ds: DatasetConfig) -> Source:
    import datasets

    try:
        d = datasets.load_dataset(repo_id, name=ds.name, split=ds.split, cache_dir=datasets_cache_dir())
    except Exception as e:
        raise_if_disk_full(e, f"dataset '{repo_id}'", datasets_cache_dir())
        raise_if_config_missing(e, f"dataset '{repo_id}'")
        config = f", config '{ds.name}'" if ds.name else ""
        what = f"'{repo_id}' (split '{ds.split}'{config}) is not a local file or directory, and as a dataset id"
        if offline():
            raise DataError(
                f"dataset {what} it is not in the datasets cache ({datasets_cache_dir()}) and downloads are off "
                f"(HF_DATASETS_OFFLINE / HF_HUB_OFFLINE); load it once online, or give a local file ({short(e)})"
            ) from None
        raise DataError(f"dataset {what} it cannot be loaded ({short(e)}); check the id, `split` and `name`") from None
    label = f"{repo_id}[{ds.split}]" if not ds.name else f"{repo_id}[{ds.name}/{ds.split}]"
    logger.info("dataset %s: %d rows (datasets cache %s)", label, len(d), datasets_cache_dir())
    return Source(repo_id, d, [Segment(0, label)], f"{repo_id}\0{ds.name}\0{ds.split}\0{d._fingerprint}")
