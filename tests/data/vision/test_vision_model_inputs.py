"""What generation hands a vision-language model (runtime/generation.py `complete`, through data.vision.Vision's
`model_inputs`): every input the checkpoint's processor returns, `mm_token_type_ids` too, for images (a batch, left
padded, odd sizes) and for a video, so that `get_rope_index` positions the visual tokens as training does; and the
check that refuses in one line a transformers whose `get_rope_index` reads an input hybridtune does not pass."""

from __future__ import annotations

import random

import pytest
import stock_vl
import torch
import vl_tiny

from hybridtune.errors import ModelError
from hybridtune.runtime import generation
from hybridtune.runtime.vision import check_rope_inputs, vision_for


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = vl_tiny.make_checkpoint(tmp_path_factory.mktemp("vl-inputs") / "ckpt")
    rng = random.Random()
    for k in range(3):
        vl_tiny.write_image(d.parent / f"{k}.png", rng.randrange(9, 60), rng.randrange(9, 60), seed=rng.randrange(999))
    vl_tiny.write_frames(d.parent / "clip", 3, 17, 29, seed=rng.randrange(999))
    return d


class Spy(torch.nn.Module):
    """A model that records what generate() is given and returns the prompt with one end-of-turn token."""

    def __init__(self, model, eos):
        super().__init__()
        self.inner, self.eos, self.seen = model, eos, []

    def get_base_model(self):
        return self.inner

    def generate(self, **kw):
        self.seen.append(kw)
        ids = kw["input_ids"]
        return torch.cat([ids, torch.full((ids.shape[0], 1), self.eos)], 1)


def _spy(ckpt):
    from transformers import AutoTokenizer, Qwen3_5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(str(ckpt))
    return Spy(Qwen3_5ForConditionalGeneration.from_pretrained(str(ckpt)).eval(), tok.eos_token_id), tok


def _same(got: dict, want: dict) -> None:
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for k, v in want.items():
        assert torch.equal(got[k].to(v.dtype), v), k


def test_images_get_every_input_the_processor_returns(ckpt):
    spy, tok = _spy(ckpt)
    vision = vision_for(ckpt, tok)
    proc = stock_vl.processor(ckpt)
    images = [[str(ckpt.parent / "0.png")], [str(ckpt.parent / "1.png"), str(ckpt.parent / "2.png")]]
    messages = [[{"role": "user", "content": stock_vl.IMAGE * len(row) + "Which?"}] for row in images]
    texts = [stock_vl.prompt(proc, m) for m in messages]
    generation.complete(spy, tok, texts, generation.Sampling(max_new_tokens=1), images=images, vision=vision)
    (got,) = spy.seen
    from PIL import Image

    pics = [Image.open(p).convert("RGB") for row in images for p in row]
    want = dict(proc(text=texts, images=pics, return_tensors="pt", add_special_tokens=False, padding=True,
                     padding_side="left"))  # fmt: skip
    assert want["mm_token_type_ids"].any()
    _same(got, want)


def test_a_video_gets_every_input_the_processor_returns(ckpt):
    from hybridtune.infer.video_prompts import complete_videos, video_arg

    spy, tok = _spy(ckpt)
    vision = vision_for(ckpt, tok)
    proc = stock_vl.processor(ckpt)
    fps = random.choice([1.0, 2.0, 3.5])
    text = stock_vl.prompt(proc, [{"role": "user", "content": stock_vl.VIDEO + "What happens?"}])
    key = video_arg(str(ckpt.parent / "clip"), fps, "--video 1")["video"]
    complete_videos(spy, tok, [text], [[key]], generation.Sampling(max_new_tokens=1), True, 1, [[]], vision)
    (got,) = spy.seen
    want = stock_vl.video_inputs(proc, text, ckpt.parent / "clip", fps)
    assert (want["mm_token_type_ids"] == 2).any()
    _same(got, want)


def test_a_get_rope_index_reading_more_is_refused_in_one_line(ckpt, monkeypatch):
    spy, tok = _spy(ckpt)
    model = spy.inner
    full = {"input_ids": torch.zeros(1, 3, dtype=torch.long), "mm_token_type_ids": torch.zeros(1, 3)}
    check_rope_inputs(spy, full)  # what transformers 5.17 reads: passed
    with pytest.raises(ModelError, match="reads mm_token_type_ids, which hybridtune's generation does not pass"):
        check_rope_inputs(spy, {"input_ids": full["input_ids"]})
    real = type(model.model).get_rope_index

    def successor(self, input_ids, mm_token_type_ids, image_grid_thw=None, video_grid_thw=None,
                  frame_times=None, attention_mask=None, **kwargs):  # fmt: skip
        return real(self, input_ids, mm_token_type_ids, image_grid_thw, video_grid_thw, attention_mask)

    monkeypatch.setattr(type(model.model), "get_rope_index", successor)
    with pytest.raises(ModelError) as e:
        check_rope_inputs(spy, full)
    assert "reads frame_times" in str(e.value) and "\n" not in str(e.value)
