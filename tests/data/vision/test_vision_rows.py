"""Chat rows with image parts, for a vision-language model: the part forms (a path relative to the data file, OpenAI's
image_url with a path or a data: URI), each image's visual tokens (never trained), and every bad image refused in one
line naming file:line and the part; the tokenisation cache keyed on the images' content."""

from __future__ import annotations

import base64
import csv
import json
import logging

import pytest
import vl_tiny
from vl_tiny import chat

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_examples, load_source
from hybridtune.data.packing import Example
from hybridtune.data.report import fit
from hybridtune.data.vision import ImageRef
from hybridtune.errors import DataError


@pytest.fixture()
def data(tmp_path):
    (tmp_path / "img").mkdir()
    vl_tiny.write_image(tmp_path / "img" / "a.png", 23, 37, seed=1)
    vl_tiny.write_image(tmp_path / "img" / "b.jpg", 50, 17, seed=2, fmt="JPEG")
    return tmp_path


def _load(path, tok, vision, rows, cache=False):
    vl_tiny.write_rows(path, rows)
    return load_source(DatasetConfig(path=str(path)), tok, cache=cache, vision=vision)


def test_image_parts_become_visual_tokens(data, tok, vision, monkeypatch, caplog):
    uri = "data:image/png;base64," + base64.b64encode((data / "img" / "a.png").read_bytes()).decode()
    rows = [
        chat("What colour? ", {"type": "image", "image": "img/a.png"}, " and ", {"type": "image_url", "image_url": {"url": "img/b.jpg"}}),
        chat("Inline: ", {"type": "image_url", "image_url": {"url": uri}}),
        chat("No image."),
    ]  # fmt: skip
    monkeypatch.chdir(data / "img")  # relative paths are the data file's, not the working directory's
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        ex = _load(data / "d.jsonl", tok, vision, rows).examples
    assert [len(e.images) for e in ex] == [2, 1, 0]
    a, b = ex[0].images
    assert a.source == str(data / "img" / "a.png") and b.source == str(data / "img" / "b.jpg")
    assert a.grid == (1, 10, 6) and a.tokens == 15 and b.grid == (1, 4, 12) and b.tokens == 12  # 24x40, 48x16 px
    assert ex[1].images[0].source == uri and ex[1].images[0].grid == a.grid
    for e in ex:
        for im in e.images:
            span = slice(im.offset, im.offset + im.tokens)
            assert set(e.input_ids[span]) == {vision.image_token_id} and not any(e.loss_mask[span])
            assert e.input_ids[im.offset - 1] == tok.convert_tokens_to_ids("<|vision_start|>")
            assert e.input_ids[im.offset + im.tokens] == tok.convert_tokens_to_ids("<|vision_end|>")
        assert e.input_ids.count(vision.image_token_id) == sum(im.tokens for im in e.images)
        assert tok.decode(e.input_ids).endswith("<|im_start|>assistant\nRed.<|im_end|>\n")
    assert "3 images in 2 examples, visual tokens per image 12 / 14 / 15" in caplog.text


def _bad_rows(data):
    (data / "empty.png").write_bytes(b"")
    (data / "text.png").write_text("not an image")
    good = (data / "img" / "a.png").read_bytes()
    (data / "cut.png").write_bytes(good[: len(good) // 2])
    (data / "folder.png").mkdir()
    return {
        "missing": ("img/nope.png", "does not exist"),
        "empty": ("empty.png", "is empty (0 bytes)"),
        "not an image": ("text.png", "is not an image PIL can read"),
        "truncated": ("cut.png", "is truncated or damaged"),
        "directory": ("folder.png", "is not a regular file"),
        "remote": ("https://example.com/a.png", "is a remote URL"),
        "bad data URI": ("data:image/png;base64,@@@", "invalid base64"),
        "data URI without base64": ("data:image/png,abc", "is not a base64 data URI"),
    }


@pytest.mark.parametrize(
    "case",
    ["missing", "empty", "not an image", "truncated", "directory", "remote", "bad data URI", "data URI without base64"],
)
@pytest.mark.parametrize("form", ["image", "image_url"])
def test_a_bad_image_is_one_line_naming_file_line_and_part(data, tok, vision, case, form):
    ref, said = _bad_rows(data)[case]
    part = {"type": "image", "image": ref} if form == "image" else {"type": "image_url", "image_url": {"url": ref}}
    rows = [chat("fine", {"type": "image", "image": "img/a.png"}), chat("No image."), chat("Look: ", part)]
    path = data / "d.jsonl"
    with pytest.raises(DataError) as e:
        _load(path, tok, vision, rows)
    msg = str(e.value)
    assert msg.startswith(f"{path}:3: message 0 (role 'user'), key 'content', content part 1 ({form}): "), msg
    assert said in msg and "\n" not in msg


def test_a_decompression_bomb_is_refused(data, tok, vision, monkeypatch):
    from PIL import Image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # a.png has 23 x 37 = 851 pixels: past the guard
    with pytest.raises(DataError) as e:
        _load(data / "d.jsonl", tok, vision, [chat("Look: ", {"type": "image", "image": "img/a.png"})])
    assert "larger than PIL's MAX_IMAGE_PIXELS (500 pixels)" in str(e.value) and ":1: message 0" in str(e.value)


def test_image_parts_without_a_vision_model_are_refused_as_before(data, tok):
    vl_tiny.write_rows(data / "d.jsonl", [chat("Look: ", {"type": "image", "image": "img/a.png"})])
    with pytest.raises(DataError, match=r"d.jsonl:1: .*content part 1 has type 'image'; only parts of type 'text'"):
        load_examples(DatasetConfig(path=str(data / "d.jsonl")), tok, cache=False)


def test_a_tokenizer_without_the_vision_tokens_trains_text_and_refuses_the_first_image(data, tok, vision):
    # (another model's tokenizer given as `tokenizer` for a vision-language checkpoint: text rows are fine)
    from hybridtune.data.vision import Vision
    from hybridtune.errors import ModelError

    ids = (vision.image_token_id + 10_000, vision.image_token_id + 10_001, vision.image_token_id + 10_002)
    blind = Vision(vision.image_processor, tok, ids[1], ids[0], ids[2])
    text = _load(data / "t.jsonl", tok, blind, [chat("No picture here")]).examples
    assert len(text) == 1 and not text[0].images and ids[1] not in text[0].input_ids
    with pytest.raises(ModelError, match=r"vision token ids .* are not in its tokenizer .*images cannot be tokenised"):
        _load(data / "d.jsonl", tok, blind, [chat("Look: ", {"type": "image", "image": "img/a.png"})])


def test_image_tokens_written_as_text_are_refused(data, tok, vision):
    with pytest.raises(DataError, match=r"d.jsonl:1: the rendered row holds 1 image token\(s\) .* for 0 image part"):
        _load(data / "d.jsonl", tok, vision, [chat("Sneaky <|image_pad|> text")])


def test_the_cache_key_holds_the_images_content(data, tok, vision, caplog):
    rows = [chat("Look: ", {"type": "image", "image": "img/a.png"})]
    first = _load(data / "d.jsonl", tok, vision, rows, cache=True)
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        again = _load(data / "d.jsonl", tok, vision, rows, cache=True)
    assert again.key == first.key and again.examples == first.examples and "from cache" in caplog.text
    vl_tiny.write_image(data / "img" / "a.png", 23, 37, seed=9)  # same size, other pixels: same tokens, new key
    changed = _load(data / "d.jsonl", tok, vision, rows, cache=True)
    assert changed.key != first.key and changed.examples == first.examples
    vl_tiny.write_image(data / "img" / "a.png", 47, 47, seed=9)  # another size: other visual tokens
    bigger = _load(data / "d.jsonl", tok, vision, rows, cache=True)
    assert bigger.key not in (first.key, changed.key) and bigger.examples[0].images[0].tokens == 36
    assert bigger.examples[0].images[0] == ImageRef(str(data / "img" / "a.png"), (1, 12, 12), 10, 36)


def test_truncation_never_cuts_an_image():
    ims = (ImageRef("a", (1, 2, 2), 2, 1), ImageRef("b", (1, 4, 4), 5, 4))
    ex = Example(list(range(12)), [0] * 9 + [1] * 3, ims)
    assert ex.truncated(12) == ex
    assert ex.truncated(8) == Example(list(range(5)), [0] * 5, ims[:1])  # b (tokens 5..8) would be cut: ends before
    assert ex.truncated(9) == Example(list(range(9)), [0] * 9, ims)
    kept, stats, records = fit([ex], lambda i: "d.jsonl:1", 8, "truncate")
    assert kept == [] and records[0]["reason"] == "no_trained_token_after_truncation"


def test_rows_json_roundtrip_of_image_parts_in_a_csv_cell(data, tok, vision):
    """A CSV cell holding the messages' JSON text reads the same image parts."""
    messages = chat("Look: ", {"type": "image", "image": "img/a.png"})["messages"]
    with open(data / "d.csv", "w", newline="") as f:
        csv.writer(f).writerows([["messages"], [json.dumps(messages)]])
    ex = load_examples(DatasetConfig(path=str(data / "d.csv")), tok, cache=False, vision=vision)
    assert ex[0].images[0].source == str(data / "img" / "a.png")


def _llava(question: str, images, answer: str = "Red.") -> dict:
    return {"conversations": [{"from": "human", "value": question}, {"from": "gpt", "value": answer}], "images": images}


def test_llava_rows_take_the_images_column_in_placeholder_order(data, tok, vision, caplog):
    rows = [_llava("<image>Compare with <image>", ["img/b.jpg", "img/a.png"]), _llava("No image here.", [])]
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        ex = _load(data / "d.jsonl", tok, vision, rows).examples
    assert "not read by format" not in caplog.text  # (the images column is read)
    chat_row = {"messages": [{"role": "user", "content": "<image> What?"}, {"role": "assistant", "content": "A."}]}
    ex += _load(data / "c.jsonl", tok, vision, [{**chat_row, "images": "img/a.png"}]).examples
    assert [[im.source.rsplit("/", 1)[1] for im in e.images] for e in ex] == [["b.jpg", "a.png"], [], ["a.png"]]
    assert [im.tokens for im in ex[0].images] == [12, 15]
    assert "<image>" not in tok.decode(ex[0].input_ids) and tok.decode(ex[0].input_ids).count("<|vision_end|>") == 2


@pytest.mark.parametrize(
    "row, said",
    [
        (_llava("<image><image>", ["img/a.png"]), "more <image> placeholders than the 1 image(s) of column 'images'"),
        (_llava("<image>", ["img/a.png", "img/b.jpg"]), "column 'images' holds 2 image(s) but the text has 1 <image>"),
        (_llava("<image>", ["img/a.png", "img/b.jpg"]), "put one <image> where each image goes"),
        (_llava("<image> and <image>", ["img/a.png", "nope.png"]), "column 'images', item 1: image file"),
        (_llava("<image>", [3]), "column 'images' must be a list of image paths, got a list"),
        ({**_llava("<video>", []), "videos": ["v.mp4"]}, "the row carries videos (column 'videos')"),
        (_llava("<video> this", []), "holds an <video> placeholder"),
    ],
)
def test_bad_llava_rows_are_one_line(data, tok, vision, row, said):
    path = data / "d.jsonl"
    with pytest.raises(DataError) as e:
        _load(path, tok, vision, [_llava("<image>", ["img/a.png"]), row])
    assert str(e.value).startswith(f"{path}:2: ") and said in str(e.value) and "\n" not in str(e.value)
    assert "text only" not in str(e.value)  # (a vision-language model trains on images: its help says so)


def test_the_cache_key_holds_the_images_column(data, tok, vision):
    rows = [_llava("<image>", ["img/a.png"])]
    first = _load(data / "d.jsonl", tok, vision, rows, cache=True)
    vl_tiny.write_image(data / "img" / "a.png", 23, 37, seed=7)
    assert _load(data / "d.jsonl", tok, vision, rows, cache=True).key != first.key


def test_tokenising_in_two_processes_gives_the_same_examples(data, tok, vision):
    rows = [chat("Look: ", {"type": "image", "image": f"img/{'a.png' if k % 2 else 'b.jpg'}"}) for k in range(6)]
    vl_tiny.write_rows(data / "d.jsonl", rows)
    ds = DatasetConfig(path=str(data / "d.jsonl"))
    one = load_examples(ds, tok, cache=False, vision=vision, num_proc=1)
    assert load_examples(ds, tok, cache=False, vision=vision, num_proc=2) == one and len(one[0].images) == 1


def test_image_placeholders_outside_chat_messages_are_still_refused(data, tok, vision):
    """An alpaca row's `<image>` is not taken (only chat and sharegpt message texts are): refused, not trained as
    text."""
    rows = [{"instruction": "<image> Name the colour", "output": "Red.", "images": ["img/a.png"]}]
    with pytest.raises(DataError, match=r"d.jsonl:1: the row carries images \(column 'images'\)"):
        _load(data / "d.jsonl", tok, vision, rows)
    with pytest.raises(DataError, match=r"d.jsonl:1: field 'instruction' holds an <image> placeholder"):
        _load(data / "d.jsonl", tok, vision, [{"instruction": "<image> Name the colour", "output": "Red."}])
