"""A row before it is formatted: which of its fields a format reads (the rest are reported once as unused), JSON
text in a cell that must hold a list or an object decoded (a CSV or TSV chat), and rows that carry images, videos or
audio refused (LLaMA-Factory's `images`/`videos`/`audios` columns, `<image>`/`<video>`/`<audio>` placeholders):
hybridtune trains on text only, so such a row would train the placeholder as text and ignore the media."""

from __future__ import annotations

import json
from typing import Any

from hybridtune.config import DatasetConfig
from hybridtune.errors import DataError

MEDIA_COLUMNS = ("images", "videos", "audios")
IMAGE_PLACEHOLDER = "<image>"  # a LLaVA-style row's next `images` item (data/vision.py)
MEDIA_PLACEHOLDERS = (IMAGE_PLACEHOLDER, "<video>", "<audio>")
MEDIA_HELP = "hybridtune trains on text only for now: drop the row, or its media column and placeholders"
VL_MEDIA_HELP = (
    'hybridtune reads videos as content parts ({"type": "video", "video": FOLDER or [frames], "fps": N}), not a '
    "'videos' column or <video> placeholders, and no audio: rewrite the row, or drop its media"
)


def message_keys(ds: DatasetConfig) -> tuple[str, ...]:
    """The fields that hold a chat's list of messages."""
    return tuple(dict.fromkeys((ds.field_messages, "messages", "conversations")))


def used_fields(fmt: str, ds: DatasetConfig, row: dict) -> set[str]:
    """The fields of `row` the format `fmt` reads."""
    if fmt == "text":
        return {ds.field_text}
    if fmt == "alpaca":
        return {ds.field_instruction, ds.field_input, ds.field_output}
    if fmt == "prompt_completion":
        return {ds.field_prompt, ds.field_completion, "tools"}
    return {messages_key(fmt, ds, row), "tools"}


def messages_key(fmt: str, ds: DatasetConfig, row: dict) -> str:
    """The field of a chat row that holds its messages (sharegpt's `conversations` when `field_messages` is absent)."""
    if fmt == "sharegpt" and ds.field_messages not in row and "conversations" in row:
        return "conversations"
    return ds.field_messages


def json_fields(fmt: str, ds: DatasetConfig) -> tuple[str, ...]:
    """The fields that must hold a list or an object (decoded from JSON text where a flat file holds a string)."""
    if fmt == "prompt_completion":
        return (ds.field_prompt, ds.field_completion, "tools")
    if fmt in ("chat", "sharegpt", "auto"):
        return (*message_keys(ds), "tools")
    return ()


def decode_json_cells(row: dict, keys: tuple[str, ...], both: tuple[str, ...] = ()) -> dict:
    """`row` with each of `keys` that holds JSON text of a list or an object decoded. `both`: keys decoded only
    together, when each is the JSON text of a list (a prompt_completion row whose prompt is plain text stays text).
    A string that is not such JSON is left as it is: the format's own check then says 'got a string'."""
    decoded = {k: v for k in keys if (v := _json_container(row.get(k))) is not None}
    if both and not all(isinstance(decoded.get(k), list) for k in both):
        for k in both:
            decoded.pop(k, None)
    return {**row, **decoded} if decoded else row


def _json_container(value: Any) -> list | dict | None:
    if not isinstance(value, str) or value.lstrip()[:1] not in ("[", "{"):
        return None
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, (list, dict)) else None


def not_json(value: Any) -> str:
    """Why a string is not the JSON of a list or an object, for an error message ('' for a non-string)."""
    if not isinstance(value, str):
        return ""
    try:
        json.loads(value)
    except json.JSONDecodeError as e:
        return f"not JSON ({e.msg} at column {e.colno})"
    return "JSON but not of a list"


def refuse_media(row: dict, fields: set[str], where: str, images: bool = False) -> None:
    """One DataError naming the row when it carries images, videos or audio: a media column with a value, or a
    placeholder in the text of a field the format reads. `images`: a vision-language model takes the `images`
    column and its `<image>` placeholders (data/vision.py)."""
    todo = VL_MEDIA_HELP if images else MEDIA_HELP
    for col in MEDIA_COLUMNS:
        if row.get(col) not in (None, "", [], "[]") and not (images and col == "images"):
            raise DataError(f"{where}: the row carries {col} (column '{col}'); {todo}")
    kinds = tuple(p for p in MEDIA_PLACEHOLDERS if not (images and p == "<image>"))
    for key in sorted(fields):
        found = _placeholder(row.get(key), kinds)
        if found:
            raise DataError(f"{where}: field '{key}' holds an {found} placeholder (a multimodal row); {todo}")


def _placeholder(value: Any, kinds: tuple[str, ...] = MEDIA_PLACEHOLDERS) -> str | None:
    if isinstance(value, str):
        return next((p for p in kinds if p in value), None)
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return next((p for p in (_placeholder(v, kinds) for v in value) if p), None)
    return None
