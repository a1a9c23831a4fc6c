"""What a failed read of a data source says, when `datasets` raised it: the innermost cause's first line (`short`),
a full disk while `datasets` wrote its Arrow copy (the datasets cache named, not the data blamed), a source of
several configs read without a name (the configs listed), and a path that names one of datasets' packaged loaders
(`csv`, `json`, ...: as a dataset id it would read every such file under the working directory)."""

from __future__ import annotations

import ast
import errno
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

from hybridtune.errors import DataError


def causes(e: BaseException | None) -> Iterator[BaseException]:
    """`e` and the errors it was raised from or during, outermost first."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = e.__cause__ or e.__context__


def innermost(e: BaseException) -> BaseException:
    return list(causes(e))[-1]


def short(e: BaseException) -> str:
    """The innermost cause's first line (datasets wraps a reader's error in its own)."""
    text = str(innermost(e)).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:300]


def raise_if_disk_full(e: BaseException, what: str, cache_dir: str) -> None:
    """A DataError naming the datasets cache `cache_dir` when `e` comes from a full disk (or quota) while `datasets`
    wrote its Arrow copy of `what`: the data is not at fault."""
    full = next((x for x in causes(e) if _is_disk_full(x)), None)
    if full is None:
        return
    cache = Path(cache_dir)
    room = next((shutil.disk_usage(d).free for d in (cache, *cache.parents) if d.exists()), None)
    free = f", {room / 2**20:,.0f} MiB free now" if room is not None else ""
    first = (str(full).strip().splitlines() or [type(full).__name__])[0][:300]
    raise DataError(
        f"the datasets cache {cache} is full ({first}{free}) while `datasets` wrote its Arrow copy of {what}; "
        "free space there, or set HF_DATASETS_CACHE to a directory on a disk with room"
    ) from None


def _is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return any(s in str(e) for s in ("No space left on device", "Disk quota exceeded"))


def raise_if_config_missing(e: BaseException, what: str) -> None:
    """A DataError listing the configs when `datasets` refused a source of several configs for want of a name (its
    own first line, 'Config name is missing.', names neither them nor the key)."""
    text = str(innermost(e))
    if not text.startswith("Config name is missing"):
        return
    found = re.search(r"available configs: (\[.*?\])", text)
    try:
        names = ", ".join(map(str, ast.literal_eval(found.group(1)))) if found else "see its README.md"
    except (ValueError, SyntaxError):
        names = found.group(1)
    raise DataError(
        f"{what} has several configs ({names}) and none was chosen; set `name` in its `datasets` entry to one of "
        "them (eval: --dataset_name)"
    ) from None


def _builder_names() -> frozenset[str]:
    """The names `datasets.load_dataset` takes as its packaged loaders (csv, json, parquet, text, ...)."""
    try:
        from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

        return frozenset(_PACKAGED_DATASETS_MODULES)
    except ImportError:  # a datasets release that moves them: the ones it has always had
        return frozenset({"arrow", "csv", "json", "pandas", "parquet", "text", "xml", "webdataset", "imagefolder"})


def refuse_builder_name(path: str) -> None:
    """A path that is no local file and names one of datasets' packaged loaders: as a dataset id it would read every
    file of that kind under the working directory (datasets' loader with no data files given), so it is refused."""
    if path in _builder_names():
        example = f" such as data.{path}" if path in ("csv", "json", "parquet", "arrow") else ""
        raise DataError(
            f"dataset '{path}' is not a local file, and as a dataset id it names the `datasets` library's {path} "
            f"loader, which would read every {path} file under the working directory; give the data file's path"
            f"{example}, a directory or a glob in `datasets` or `--dataset`"
        )
