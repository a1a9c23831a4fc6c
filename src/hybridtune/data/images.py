"""Images named by data rows: where a content part points (`image_source`: a local path resolved against the data
file's folder, or a `data:` URI; a remote URL refused, hybridtune reads nothing from the network), its bytes and their
sha256 (`image_bytes`, `image_digest`), and the image decoded whole and checked (`load_image`). Every bad image (missing,
not a regular file, empty, not an image, truncated, more pixels than PIL's MAX_IMAGE_PIXELS) is one DataError naming
the row (`where`, 'file:LINE') and the part (`what`). A path must lie inside the data file's folder or an
`image_roots` folder, links resolved (`confined`), unless `allow_outside_images` (`set_image_policy`): then each read
outside is logged."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import logging
import os
import re
import stat
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridtune.errors import DataError

logger = logging.getLogger(__name__)

DATA_URI = "data:"
EMBEDDED = "data:image;base64,"  # the source of an image whose bytes the data holds (`embedded`)
REMOTE = ("http://", "https://", "ftp://", "s3://", "gs://", "hf://")
URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # any other scheme (sftp://, smb://): not a path either
IMAGE_PART_TYPES = ("image", "image_url")
MAX_ASPECT = 200  # transformers' smart_resize (Qwen2-VL to Qwen3-VL processors) raises a ValueError beyond it


def is_image_part(part: Any) -> bool:
    """A chat content part that holds an image: `{"type": "image", ...}` or `{"type": "image_url", ...}`."""
    return isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES


def embedded(value: Any) -> str | None:
    """An image as `datasets` stores an Image feature (`{"bytes": ..., "path": ...}`, read undecoded): a `data:` URI
    of its bytes, else (no bytes) its path; None for any other value."""
    if not (isinstance(value, dict) and value and set(value) <= {"bytes", "path"}):
        return None
    data, path = value.get("bytes"), value.get("path")
    if isinstance(data, (bytes, bytearray, memoryview)):
        return EMBEDDED + base64.b64encode(bytes(data)).decode("ascii")
    return path if isinstance(path, str) and path.strip() else None


def undecoded_images(dataset: Any) -> Any:
    """`dataset` with its Image features (at any depth: a column, an image inside messages' content parts) read as
    `{"bytes", "path"}`: hybridtune decodes and checks each image itself (`load_image`), never datasets."""
    features = getattr(dataset, "features", None)
    if not features:
        return dataset
    import datasets
    from datasets.features.features import _visit

    found = []

    def undecode(f):
        if isinstance(f, datasets.Image) and f.decode:
            found.append(f)
            return datasets.Image(decode=False)
        return f  # (a container as visited: _visit keeps the original for None)

    plain = _visit(features, undecode)
    return dataset.cast(plain) if found else dataset


def part_reference(part: dict, where: str, what: str) -> str:
    """The path or URI an image part names: `{"type": "image", "image": REF}` (also `"path"` or `"url"` there), or
    OpenAI's `{"type": "image_url", "image_url": {"url": REF}}` (or the URL as a plain string)."""
    if part.get("type") == "image_url":
        ref = part.get("image_url")
        ref = ref.get("url") if isinstance(ref, dict) else ref
        shape = '{"type": "image_url", "image_url": {"url": PATH or data: URI}}'
    else:
        ref = next((part[k] for k in ("image", "path", "url") if part.get(k) is not None), None)
        ref = embedded(ref) or ref  # (an image a `datasets` Image feature holds: its bytes)
        shape = '{"type": "image", "image": PATH or data: URI}'
    if not isinstance(ref, str) or not ref.strip():
        got = "nothing" if ref is None else f"{type(ref).__name__} {str(ref)[:40]!r}"
        raise DataError(f"{where}: {what}: an image part names no image (got {got}); write it as {shape}")
    return ref.strip()


@dataclass(frozen=True)
class ImagePolicy:
    """Where a data file's images may be read from: its own folder and `roots`; anywhere when `allow_outside`."""

    allow_outside: bool = False
    roots: tuple[str, ...] = ()


_policy = ImagePolicy()
_logged: set[str] = set()  # the reads outside already logged (one line each)


def set_image_policy(allow_outside: bool = False, roots: Sequence[str] = ()) -> ImagePolicy:
    """The config's `allow_outside_images` and `image_roots`, for every image read from now on (in this process and
    the tokenising workers it forks; `image_policy()` is passed to spawned ones). Returns the policy."""
    global _policy
    _policy = ImagePolicy(bool(allow_outside), tuple(os.path.realpath(os.path.expanduser(r)) for r in roots))
    return _policy


def image_policy() -> ImagePolicy:
    return _policy


def _inside(real: str, folder: str) -> bool:
    return real == folder or real.startswith(folder.rstrip(os.sep) + os.sep)


def confined(path: str, base: Path | None, where: str, what: str) -> str:
    """`path` when it resolves (every link followed) inside `base` (the data file's folder) or an `image_roots`
    folder; else a DataError, or under `allow_outside_images` a log line naming the read. `base` None: a path the
    user typed (`generate --image`), not read from a file, is not confined."""
    if base is None:
        return path
    real = os.path.realpath(path)
    folders = (os.path.realpath(base), *_policy.roots)
    if any(_inside(real, f) for f in folders):
        return path
    if _policy.allow_outside:
        if real not in _logged:
            _logged.add(real)
            logger.warning("images: reading %s, outside the data folder %s (allow_outside_images: true)", real, base)
        return path
    shown = f"'{path}'" + (f" (a link to '{real}')" if real != os.path.abspath(path) else "")
    raise DataError(
        f"{where}: {what}: image {shown} lies outside the data file's folder {base}; a data file reads images from "
        "its own folder only: move the image there, or (train, eval, data) list its folder in `image_roots` or set "
        "`allow_outside_images: true` if you trust the data (generate: give it with --image)"
    )


def regular(path: str, where: str, what: str) -> str:
    """`path` when it is a regular file (a link followed to one), else a DataError naming it: a pipe would block the
    read, a device never end."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"{where}: {what}: '{path}' cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise DataError(
            f"{where}: {what}: '{path}' is not a regular file (a pipe, a device or a folder); remove it or replace "
            "it with the image itself"
        )
    return path


def image_source(ref: str, base: Path | None, where: str, what: str) -> str:
    """`ref` as hybridtune reads it: a `data:` URI as it is, a `file://` URI or a path made absolute (a relative path
    is taken from `base`, the data file's folder) and `confined` to it. A URL of any other scheme is refused: nothing
    is fetched."""
    if ref.startswith(DATA_URI):
        return ref
    if "\0" in ref:  # (os.stat raises ValueError for it: a traceback)
        raise DataError(f"{where}: {what}: image path {_short(ref)} holds a NUL character; fix the path")
    if ref.lower().startswith(REMOTE):
        raise DataError(
            f"{where}: {what}: image {_short(ref)} is a remote URL; hybridtune reads no images from the network "
            "(training runs offline): download it and give its local path, relative to the data file"
        )
    if ref.lower().startswith(("file://localhost/", "file:///")):
        ref = ref[len("file://localhost") :] if ref.lower().startswith("file://localhost/") else ref[len("file://") :]
    elif URI.match(ref):
        raise DataError(
            f"{where}: {what}: image {_short(ref)} is a URL ({ref.split(':', 1)[0]}:// is not a local file); "
            "hybridtune reads local files and data: URIs only: copy the image here and give its path"
        )
    path = Path(ref).expanduser()
    if not path.is_absolute():
        path = (base or Path.cwd()) / path
    return confined(str(path), base, where, what)


def _short(ref: str) -> str:
    return repr(ref if len(ref) <= 80 else ref[:77] + "...")


def describe(source: str) -> str:
    """A source for a message: the path, or the start of a data URI."""
    return f"data URI {_short(source)}" if source.startswith(DATA_URI) else f"'{source}'"


def image_bytes(source: str, where: str, what: str) -> bytes:
    """The encoded image: a regular file's bytes (a link is followed to one), or a base64 `data:` URI decoded."""
    if source.startswith(DATA_URI):
        head, sep, payload = source.partition(",")
        if not sep or not head.endswith(";base64"):
            raise DataError(
                f"{where}: {what}: {describe(source)} is not a base64 data URI; write it as "
                "data:image/png;base64,<base64 of the file>"
            )
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise DataError(f"{where}: {what}: {describe(source)} holds invalid base64 ({e})") from None
        if not data:
            raise DataError(f"{where}: {what}: {describe(source)} is empty (0 bytes); give the image's bytes")
        return data
    try:
        st = os.stat(source)
    except FileNotFoundError:
        raise DataError(
            f"{where}: {what}: image file '{source}' does not exist (relative paths are taken from the data "
            "file's folder); fix the path or drop the part"
        ) from None
    except OSError as e:
        raise DataError(f"{where}: {what}: image file '{source}' cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(st.st_mode):
        raise DataError(f"{where}: {what}: image '{source}' is not a regular file (a directory, a device or a pipe)")
    if st.st_size == 0:
        raise DataError(f"{where}: {what}: image file '{source}' is empty (0 bytes); replace it or drop the part")
    try:
        with open(source, "rb") as f:
            return f.read()
    except OSError as e:
        raise DataError(f"{where}: {what}: image file '{source}' cannot be read ({e.strerror})") from None


def image_digest(source: str, where: str = "", what: str = "") -> str:
    """sha256 of the image's bytes; 'missing' when it cannot be read (the error itself is raised where the row is
    tokenised, with its line)."""
    try:
        return hashlib.sha256(image_bytes(source, where, what)).hexdigest()
    except DataError:
        return "missing"


def load_image(source: str, where: str, what: str):
    """The image decoded whole, in RGB (a PIL image). Decoding everything here finds a truncated file now, not in a
    training step; an image over PIL's MAX_IMAGE_PIXELS (its decompression-bomb guard) is refused."""
    from PIL import Image, UnidentifiedImageError  # why here: only rows with images need Pillow

    data = image_bytes(source, where, what)
    limit = Image.MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                if im.width == 0 or im.height == 0:
                    raise DataError(f"{where}: {what}: image {describe(source)} has no pixels ({im.width}x{im.height})")
                if max(im.size) > MAX_ASPECT * min(im.size):  # (the header's size: refused before decoding)
                    raise DataError(
                        f"{where}: {what}: image {describe(source)} is {im.width}x{im.height}, a side more than "
                        f"{MAX_ASPECT} times the other (Qwen's vision processors refuse it); crop or pad it"
                    )
                im.load()
                return im.convert("RGB")
    except DataError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(
            f"{where}: {what}: image {describe(source)} is larger than PIL's MAX_IMAGE_PIXELS ({limit} pixels), its "
            f"guard against decompression bombs ({_first_line(e)}); shrink the image or drop the part"
        ) from None
    except UnidentifiedImageError:
        raise DataError(
            f"{where}: {what}: {describe(source)} is not an image PIL can read (PNG, JPEG, WebP, GIF, BMP, TIFF...); "
            "replace it or drop the part"
        ) from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL: 'image file is truncated', broken chunks, bad headers
        raise DataError(
            f"{where}: {what}: image {describe(source)} is truncated or damaged ({_first_line(e)}); replace it or "
            "drop the part"
        ) from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
