"""Rows that carry images, videos or audio (LLaMA-Factory's `images`/`videos` columns, `<image>` placeholders) are
refused in one line naming the file and line: hybridtune trains on text only, and would otherwise train the
placeholder as text and ignore the media."""

from __future__ import annotations

import json

import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_examples
from hybridtune.errors import DataError
from hybridtune.models.tokenizer_files import bundled_tokenizer


@pytest.fixture(scope="module")
def tok():
    return bundled_tokenizer()


def sharegpt(question: str, **extra) -> dict:
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": "Red."}], **extra}


def load(tmp_path, rows, tok, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p, lambda: load_examples(DatasetConfig(path=str(p)), tok, cache=False)


@pytest.mark.parametrize(
    "row, said",
    [
        (sharegpt("<image>What colour is this?", images=["a.png"]), "the row carries images (column 'images')"),
        (sharegpt("What colour is this?", images=["a.png"]), "the row carries images (column 'images')"),
        (sharegpt("<image>What colour is this?"), "field 'conversations' holds an <image> placeholder"),
        (sharegpt("Describe <video>", videos=["v.mp4"]), "the row carries videos (column 'videos')"),
        (sharegpt("Describe <video>"), "field 'conversations' holds an <video> placeholder"),
        ({"instruction": "<image>Name the colour", "output": "Red."}, "field 'instruction' holds an <image>"),
        (
            {"messages": [{"role": "user", "content": "<audio>Transcribe"}, {"role": "assistant", "content": "hi"}]},
            "field 'messages' holds an <audio> placeholder",
        ),
    ],
)
def test_a_multimodal_row_is_refused_naming_its_line(tok, tmp_path, row, said):
    plain = {k: v for k, v in row.items() if k not in ("images", "videos")}
    ok = json.loads(json.dumps(plain).replace("<image>", "").replace("<video>", "").replace("<audio>", ""))
    p, run = load(tmp_path, [ok, ok, row], tok)
    with pytest.raises(DataError) as e:
        run()
    msg = str(e.value)
    assert msg.startswith(f"{p}:3: ") and said in msg and "text only" in msg
    assert "\n" not in msg


def test_empty_media_columns_and_text_rows_train(tok, tmp_path):
    # An `images` column that is empty in a row (as a table gives every row every column) is no image.
    _, run = load(tmp_path, [sharegpt("What is red?", images=[]), sharegpt("And blue?", images=None)], tok)
    assert len(run()) == 2
