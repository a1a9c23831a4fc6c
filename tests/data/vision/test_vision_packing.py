"""A pack mixing text-only and image documents (several images per document, two of them adjacent, odd image sizes,
one video of frames beside an image) equals each document run alone, unpacked, through stock transformers (which
computes its own M-RoPE positions with `get_rope_index`, and takes the video whole as `pixel_values_videos`): the
packed forward's logits and every trained gradient (the text model, full fine-tune), fp32 on the CPU, within 1e-5;
the same under the compiled loop (one graph, 0 breaks on the language model). The naive position rows (a document's
2-D text row, the pack's one row) visibly break it; the documents' boundaries come from cu_seq_lens, whatever the
position row says."""

from __future__ import annotations

import copy

import pytest
import torch
import vl_tiny
from vl_tiny import chat

from hybridtune.batch import LABELS, MROPE_POSITION_IDS, POSITION_IDS
from hybridtune.config import DatasetConfig
from hybridtune.data import PackedCollator
from hybridtune.data.examples import load_examples
from hybridtune.data.images import load_image
from hybridtune.data.vision import rope_positions
from hybridtune.models.loading import freeze_non_text
from hybridtune.models.patching import patch_model
from hybridtune.runtime.step import model_inputs
from hybridtune.train.objectives.sft import SFT

TOL = dict(rtol=1e-5, atol=1e-5)
SIZES = [(23, 37), (50, 17), (31, 31), (16, 45), (40, 29)]  # width x height: none a multiple of 8


def _image(name: str) -> dict:
    return {"type": "image", "image": name}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl")
    (d / "img").mkdir()
    names = [f"img/{k}.png" for k in range(len(SIZES))]
    for k, (w, h) in enumerate(SIZES):
        vl_tiny.write_image(d / names[k], w, h, seed=k)
    rows = [
        chat("Say something about red."),
        chat("Compare ", _image(names[0]), " with ", {"type": "image_url", "image_url": {"url": names[1]}}, "?"),
        chat(_image(names[2]), _image(names[3]), "Which is brighter, and this one: ", _image(names[4]), answer="B."),
        chat("And blue?", answer="Blue is calm."),
    ]
    vl_tiny.write_frames(d / "clip", 5, 23, 37, seed=7)  # 5 frames: 3 temporal groups, the last frame repeated
    video = {"type": "video", "video": "clip", "fps": 3}
    rows.append(chat("See ", video, " and ", _image(names[1]), "?", answer="A dot moves."))
    path = vl_tiny.write_rows(d / "data.jsonl", rows)
    model, tok = vl_tiny.build_model(seed=0)
    vision = vl_tiny.vision_of(tok)
    examples = load_examples(DatasetConfig(path=str(path)), tok, cache=False, vision=vision)
    assert [len(e.images) for e in examples] == [0, 2, 3, 0, 4]  # (the video: one ref per temporal group)
    ref = copy.deepcopy(model)  # stock transformers: no patch
    patch_model(model)
    for m in (model, ref):
        for p in m.parameters():
            p.requires_grad_(True)
        freeze_non_text(m)
    return model, ref, vision, examples


def _alone(ref, vision, ex) -> dict:
    """Stock transformers' inputs for one document alone, as its processor gives them."""
    ids = torch.tensor([ex.input_ids])
    kw = {"input_ids": ids}
    stills = [r for r in ex.images if r.group < 0]
    if stills:
        pixels, grid = vision.process([load_image(r.source, "", "") for r in stills])
        kw.update(pixel_values=pixels, image_grid_thw=grid)
    videos = list(dict.fromkeys(r.source for r in ex.images if r.group >= 0))
    if videos:
        whole = [vision.video(v, "", "") for v in videos]  # each video whole, as its processor gives it
        kw.update(
            pixel_values_videos=torch.cat([v for v, _ in whole]), video_grid_thw=torch.tensor([g for _, g in whole])
        )
    if ex.images:
        kw["mm_token_type_ids"] = (ids == vision.image_token_id).int() + 2 * (ids == vision.video_token_id).int()
    return kw


def _reference(ref, vision, examples, labels, num_items):
    """Each document alone: its logits, and the gradients of the sum of the documents' losses."""
    ref.zero_grad()
    logits, start = [], 0
    for ex in examples:
        out = ref(**_alone(ref, vision, ex))
        lab = labels[0, start : start + len(ex)]
        start += len(ex)
        loss = torch.nn.functional.cross_entropy(out.logits[0, :-1], lab[1:], ignore_index=-100, reduction="sum")
        (loss / num_items).backward()
        logits.append(out.logits[0].detach())
    return logits, {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}


def _packed(model, batch, fused: bool):
    model.zero_grad()
    with torch.no_grad():
        logits = model(**model_inputs(batch, labels=False, model=model)).logits[0]
    SFT(fused=fused).loss(model, batch, batch["num_loss_tokens"]).backward()
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _split(logits, examples):
    out, start = [], 0
    for ex in examples:
        out.append(logits[start : start + len(ex)])
        start += len(ex)
    return out


def _train(models, everything: bool) -> None:
    """Train the text model only (the default), or everything: the vision tower and its merger too."""
    for m in models:
        for p in m.parameters():
            p.requires_grad_(True)
        if not everything:
            freeze_non_text(m)


def _check(model, ref, vision, examples, fused, everything):
    batch = PackedCollator(vision=vision)(examples)
    assert batch["image_grid_thw"].shape == (9, 3) and batch[MROPE_POSITION_IDS].shape == (3, sum(map(len, examples)))
    visual = (batch["input_ids"] == vision.image_token_id) | (batch["input_ids"] == vision.video_token_id)
    assert not (batch[LABELS][visual] != -100).any()  # no loss on visual tokens
    want_logits, want_grads = _reference(ref, vision, examples, batch[LABELS], batch["num_loss_tokens"])
    logits, grads = _packed(model, batch, fused)
    for got, want in zip(_split(logits, examples), want_logits):
        torch.testing.assert_close(got, want, **TOL)
    assert set(grads) == set(want_grads) and len(grads) > 20
    assert any(n.startswith("model.visual") for n in grads) == everything
    for name, g in grads.items():
        assert g is not None and (everything or not name.startswith("model.visual")), name
        torch.testing.assert_close(g, want_grads[name], **TOL, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("everything", [False, True], ids=["text-trained", "tower-trained"])
@pytest.mark.parametrize("fused", [False, True], ids=["model-loss", "fused-loss"])
def test_packed_equals_each_document_alone(setup, fused, everything):
    model, ref, vision, examples = setup
    _train((model, ref), everything)
    try:
        _check(model, ref, vision, examples, fused, everything)
    finally:
        _train((model, ref), False)


@pytest.mark.slow  # (19 s: dynamo traces the patched text model twice)
def test_compiled_loop_equals_each_document_alone_in_one_graph(setup):
    """The compiled loop (dynamo's eager backend: its capture) takes the pack's image and video embeddings as
    `inputs_embeds`: 0 breaks on the language model, one graph per grad mode (the no-grad logits forward and the
    training forward: grad mode is one of dynamo's guards), and the same logits and gradients."""
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop

    model, ref, vision, examples = setup
    torch._dynamo.reset()
    handle = compile_loop(model, backend="eager")
    counters.clear()
    try:
        _check(model, ref, vision, examples, fused=True, everything=False)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 2 and handle.calls == 2 and handle.eager_calls == 0
    finally:
        handle.undo()
        torch._dynamo.reset()


def test_positions_are_get_rope_index_of_each_document_alone(setup):
    _, ref, vision, examples = setup
    for ex in examples:
        kw = _alone(ref, vision, ex)
        if not ex.images:
            continue
        want, _ = ref.model.get_rope_index(
            kw["input_ids"], kw["mm_token_type_ids"], kw.get("image_grid_thw"), kw.get("video_grid_thw")
        )
        assert torch.equal(rope_positions(len(ex), ex.images, vision.merge), want[:, 0])


def _two_d(n, images, merge):  # a document's text row on all three axes: its images lose their grid positions
    return torch.arange(n).expand(3, n)


@pytest.mark.parametrize("naive", ["document-2d-row", "pack-row"])
def test_naive_position_rows_break_equality(setup, monkeypatch, naive):
    """The same check fails with the rows other packers used: it would catch a regression to either."""
    model, ref, vision, examples = setup
    if naive == "document-2d-row":
        monkeypatch.setattr("hybridtune.data.collator.rope_positions", _two_d)
    batch = PackedCollator(vision=vision)(examples)
    if naive == "pack-row":
        T = batch[POSITION_IDS].shape[-1]
        batch[MROPE_POSITION_IDS] = torch.arange(T).expand(3, T)
    want_logits, _ = _reference(ref, vision, examples, batch[LABELS], batch["num_loss_tokens"])
    with torch.no_grad():
        logits = model(**model_inputs(batch, labels=False, model=model)).logits[0]
    diffs = [(got - want).abs().max().item() for got, want in zip(_split(logits, examples), want_logits)]
    assert min(diffs[1], diffs[2], diffs[4]) > 1e-3  # the image and video documents are wrong
    if naive == "document-2d-row":
        assert diffs[0] < 1e-5 and diffs[3] < 1e-5  # (text documents are not: it is the positions)


def test_document_boundaries_come_from_cu_seq_lens_not_positions(setup):
    """The text position row counting on across the pack changes nothing: boundaries are the collator's."""
    model, ref, vision, examples = setup
    batch = PackedCollator(vision=vision)(examples)
    with torch.no_grad():
        want = model(**model_inputs(batch, labels=False, model=model)).logits
        T = batch[POSITION_IDS].shape[-1]
        batch[POSITION_IDS] = torch.arange(T)[None]
        got = model(**model_inputs(batch, labels=False, model=model)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
