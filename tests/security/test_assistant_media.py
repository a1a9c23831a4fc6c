"""Media in a trained turn (data/formats.py `refuse_trained_media`): an image or video part, or an `<image>`
placeholder, in an assistant message (a completion, a ShareGPT `gpt` turn, a role of `roles_to_train`) would train
the vision start and end tokens around it, so the model learns to begin replies with vision tokens it cannot fill.
Each is one line naming file:line and the message; the same media in a user turn trains as before."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from hybridtune.config import DatasetConfig
from hybridtune.data.examples import load_source
from hybridtune.errors import DataError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "data" / "vision"))
import vl_tiny  # noqa: E402


@pytest.fixture()
def folder(tmp_path):
    vl_tiny.write_image(tmp_path / "a.png", random.randint(9, 40), random.randint(9, 40), seed=random.randrange(99))
    vl_tiny.write_frames(tmp_path / "clip", 2, 16, 16, seed=random.randrange(99))
    return tmp_path


IMAGE = {"type": "image", "image": "a.png"}
IMAGE_URL = {"type": "image_url", "image_url": {"url": "a.png"}}
VIDEO = {"type": "video", "video": "clip", "fps": 2}


def _load(folder, tok, vision, rows, **ds):
    path = vl_tiny.write_rows(folder / "d.jsonl", rows)
    return load_source(DatasetConfig(path=str(path), **ds), tok, cache=False, vision=vision)


def _assistant(*parts):
    return [{"role": "assistant", "content": [*parts, {"type": "text", "text": "Red."}]}]


@pytest.mark.parametrize("part", [IMAGE, IMAGE_URL, VIDEO], ids=["image", "image_url", "video"])
def test_a_media_part_in_an_assistant_message_is_refused(folder, tok, vision, part):
    rows = [vl_tiny.chat("Which colour?")] * random.randint(0, 2)
    rows.append({"messages": [{"role": "user", "content": "Which colour?"}, *_assistant(part)]})
    with pytest.raises(DataError, match=rf"d\.jsonl:{len(rows)}: message 1 \(role 'assistant'\).*content part 0 "
                       r"\(\w+\) is media in a trained turn"):  # fmt: skip
        _load(folder, tok, vision, rows)


def test_a_completion_with_an_image_is_refused(folder, tok, vision):
    row = {"prompt": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "colour?"}]}],
           "completion": _assistant(IMAGE)}  # fmt: skip
    with pytest.raises(DataError, match=r"d\.jsonl:1: message 0 .*media in a trained turn"):
        _load(folder, tok, vision, [row])


def test_a_sharegpt_placeholder_in_a_gpt_turn_is_refused(folder, tok, vision):
    row = {"conversations": [{"from": "human", "value": "<image>Which colour?"}, {"from": "gpt", "value": "<image>"}],
           "images": ["a.png", "a.png"]}  # fmt: skip
    with pytest.raises(DataError, match=r"d\.jsonl:1: message 1 .*<image> placeholder is media in a trained turn"):
        _load(folder, tok, vision, [row])


def test_a_role_named_in_roles_to_train_is_a_trained_turn(folder, tok, vision):
    row = {"messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "?"}]},
                        {"role": "assistant", "content": "Red."}]}  # fmt: skip
    assert len(_load(folder, tok, vision, [row]).examples[0].images) == 1  # a user's image: trains as before
    with pytest.raises(DataError, match=r"message 0 \(role 'user'\).*media in a trained turn \(role 'user'\)"):
        _load(folder, tok, vision, [row], roles_to_train=["user", "assistant"])
    with pytest.raises(DataError, match=r"drop 'user' from the dataset's roles_to_train") as e:  # (not "a user turn")
        _load(folder, tok, vision, [row], roles_to_train=["assistant", "user"])
    assert "into a user turn" not in str(e.value)


def test_media_in_user_turns_still_train_with_untrained_vision_tokens(folder, tok, vision):
    llava = {"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "Red."}]}
    rows = [vl_tiny.chat(IMAGE, "Which?"), vl_tiny.chat(VIDEO, "Which?"), {**llava, "images": ["a.png"]}]
    examples = _load(folder, tok, vision, rows).examples
    start, end = tok.convert_tokens_to_ids(["<|vision_start|>", "<|vision_end|>"])
    for ex in examples:
        assert ex.images
        assert not any(m for t, m in zip(ex.input_ids, ex.loss_mask) if t in (start, end))
