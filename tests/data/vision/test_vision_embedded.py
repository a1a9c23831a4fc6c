"""Parquet and Arrow data written by `datasets` with Image features (the images' bytes embedded in the file): chat rows
whose content parts hold them and LLaVA rows whose `images` column does, read undecoded (hybridtune decodes and checks
each image itself) and tokenised exactly as the same images given as files; a truncated image or a decompression bomb
in the bytes is one line naming file:line and the part."""

from __future__ import annotations

import datasets
import pytest
import vl_tiny

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_source
from hybridtune.errors import DataError

IMAGE = datasets.Image()
PART = {"type": datasets.Value("string"), "text": datasets.Value("string"), "image": IMAGE}
CHAT = datasets.Features(
    {"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.List(PART)})}
)
LLAVA = datasets.Features(
    {
        "messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")}),
        "images": datasets.List(IMAGE),
    }
)


@pytest.fixture()
def img(tmp_path):
    (tmp_path / "img").mkdir()
    return [
        vl_tiny.write_image(tmp_path / "img" / f"{k}.png", w, h, seed=k)
        for k, (w, h) in enumerate([(23, 37), (50, 17)])
    ]


def _embed(path):
    """An image as datasets stores an embedded one (what `push_to_hub` and `embed_table_storage` write)."""
    return {"bytes": path.read_bytes(), "path": path.name}


def _chat_rows(parts_of_rows):
    return {
        "messages": [
            [
                {"role": "user", "content": [{"type": "text", "text": None, "image": None, **p} for p in parts]},
                {"role": "assistant", "content": [{"type": "text", "text": "Red.", "image": None}]},
            ]
            for parts in parts_of_rows
        ]
    }


def _write(ds: datasets.Dataset, path, kind):
    if kind == "parquet":
        ds.to_parquet(str(path))
    else:  # an Arrow file as datasets saves a dataset
        ds.save_to_disk(str(path.parent / "saved"))
        (path.parent / "saved" / next(p.name for p in (path.parent / "saved").glob("*.arrow"))).rename(path)
    return path


def _load(path, tok, vision):
    return load_source(DatasetConfig(path=str(path)), tok, cache=False, vision=vision).examples


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_chat_rows_with_embedded_images_equal_the_same_images_as_files(tmp_path, img, tok, vision, kind):
    parts = [
        [{"text": "Compare "}, {"type": "image", "image": _embed(img[0])}, {"type": "image", "image": _embed(img[1])}],
        [{"text": "No image."}],
    ]
    ds = datasets.Dataset.from_dict(_chat_rows(parts), features=CHAT)  # datasets embeds the files' bytes
    assert ds.features["messages"].feature["content"].feature["image"] == IMAGE
    got = _load(_write(ds, tmp_path / f"d.{kind}", kind), tok, vision)
    want = _load(
        vl_tiny.write_rows(
            tmp_path / "d.jsonl",
            [
                vl_tiny.chat(
                    "Compare ", {"type": "image", "image": "img/0.png"}, {"type": "image", "image": "img/1.png"}
                ),
                vl_tiny.chat("No image."),
            ],
        ),
        tok,
        vision,
    )
    assert [e.input_ids for e in got] == [e.input_ids for e in want]
    assert [e.loss_mask for e in got] == [e.loss_mask for e in want]
    assert [[(r.grid, r.offset, r.tokens) for r in e.images] for e in got] == [
        [(r.grid, r.offset, r.tokens) for r in e.images] for e in want
    ]
    assert got[0].images[0].source.startswith("data:image;base64,")
    px_got, _ = vision.pixels(got[0].images)
    px_want, _ = vision.pixels(want[0].images)
    assert px_got.equal(px_want)


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_llava_rows_with_an_embedded_images_column(tmp_path, img, tok, vision, kind):
    rows = {
        "messages": [
            [{"role": "user", "content": "<image>Which colour?<image>"}, {"role": "assistant", "content": "Red."}]
        ],
        "images": [[_embed(img[0]), _embed(img[1])]],
    }
    ds = datasets.Dataset.from_dict(rows, features=LLAVA)
    got = _load(_write(ds, tmp_path / f"d.{kind}", kind), tok, vision)
    assert [r.grid for r in got[0].images] == [(1, 10, 6), (1, 4, 12)]  # 24x40 and 48x16 pixels
    assert all(r.source.startswith("data:image;base64,") for r in got[0].images)


def _cut(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


@pytest.mark.parametrize("case", ["truncated", "bomb"])
@pytest.mark.parametrize("form", ["chat", "llava"])
def test_bad_embedded_bytes_are_one_line(tmp_path, img, tok, vision, monkeypatch, case, form):
    from PIL import Image

    bad = _cut(img[1]) if case == "truncated" else vl_tiny.write_image(tmp_path / "big.png", 60, 60)
    if case == "bomb":
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 2000)  # 60 x 60 = 3600 pixels: past the guard (the others not)
    if form == "chat":
        parts = [[{"text": "fine"}], [{"text": "Look: "}, {"type": "image", "image": _embed(bad)}]]
        ds = datasets.Dataset.from_dict(_chat_rows(parts), features=CHAT)
        where = "message 0 (role 'user'), key 'content', content part 1 (image)"
    else:
        msgs = [{"role": "user", "content": "<image>Which?"}, {"role": "assistant", "content": "Red."}]
        ds = datasets.Dataset.from_dict(
            {"messages": [msgs, msgs], "images": [[_embed(img[0])], [_embed(bad)]]}, features=LLAVA
        )
        where = "column 'images', item 0"
    path = _write(ds, tmp_path / "d.parquet", "parquet")
    with pytest.raises(DataError) as e:
        _load(path, tok, vision)
    msg = str(e.value)
    said = "is truncated or damaged" if case == "truncated" else "larger than PIL's MAX_IMAGE_PIXELS (2000 pixels)"
    assert msg.startswith(f"{path}:row 2: "), msg
    assert where in msg and said in msg and "data URI 'data:image;base64," in msg and "\n" not in msg
