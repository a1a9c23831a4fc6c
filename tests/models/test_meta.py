"""A model built on the meta device and filled (`load_model(meta=True)` + `materialize`) equals the plain load, bit for
bit: every parameter (dtype, requires_grad, tying), every buffer, for each checkpoint kind (fp32 and bf16 files, the
frozen vision tower as saved, per-expert files fused) and for the presets (their seeded init). The sharded case (FSDP2
over 2 processes) is tests/runtime/test_distributed_meta.py."""

from __future__ import annotations

import pytest
import torch

from checkpoints import KINDS, make_checkpoint, read_tensors
from hybridtune.errors import ModelError
from hybridtune.models.loading import load_model, materialize
from hybridtune.models.meta import CheckpointReader, PresetReader, fill, skeleton
from hybridtune.models.presets import preset_config
from hybridtune.models.tokenizer_files import bundled_tokenizer


def assert_same_model(got: torch.nn.Module, want: torch.nn.Module) -> None:
    g, w = dict(got.named_parameters(remove_duplicate=False)), dict(want.named_parameters(remove_duplicate=False))
    assert g.keys() == w.keys()
    for name in w:
        assert g[name].dtype == w[name].dtype, name
        assert g[name].requires_grad == w[name].requires_grad, name
        assert torch.equal(g[name], w[name]), name
    # tied parameters stay one tensor
    assert [n for n, _ in got.named_parameters()] == [n for n, _ in want.named_parameters()]
    gb, wb = dict(got.named_buffers()), dict(want.named_buffers())
    assert gb.keys() == wb.keys() and all(torch.equal(gb[k], wb[k]) for k in wb)
    assert got.training == want.training


def meta_then_filled(source, **kw):
    loaded = load_model(source, **kw, meta=True)
    assert all(p.is_meta for p in loaded.model.parameters()) and loaded.reader is not None
    stats = materialize(loaded, loaded.model, torch.device("cpu"))
    assert loaded.reader is None
    return loaded, stats


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("saved", [torch.float32, torch.bfloat16])
def test_checkpoint_meta_equals_plain(tmp_path, kind, saved):
    path = make_checkpoint(tmp_path, kind, saved, seed=5)
    for dtype in (None, torch.float32):  # as saved; the text part cast for a full fine-tune
        want = load_model(str(path), dtype=dtype)
        got, stats = meta_then_filled(str(path), dtype=dtype)
        assert_same_model(got.model, want.model)
        assert got.source_dtype == want.source_dtype == saved
        assert (
            stats.local_bytes == stats.model_bytes == sum(p.numel() * p.element_size() for p in want.model.parameters())
        )
        assert 0 < stats.staged_bytes < stats.model_bytes  # one tensor (or one expert stack) at a time


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_next"])
def test_preset_meta_equals_plain_and_is_seeded(name):
    tok = bundled_tokenizer()
    want = load_model(name, tok, seed=11, dtype=torch.bfloat16)
    got, stats = meta_then_filled(name, tokenizer=tok, seed=11, dtype=torch.bfloat16)
    assert_same_model(got.model, want.model)
    assert 0 < stats.staged_bytes <= 0.5 * stats.model_bytes  # about one block of the init at a time (4 layers)
    again = load_model(name, tok, seed=11).model
    other = load_model(name, tok, seed=12).model
    weights = [n for n, p in again.named_parameters() if p.dim() == 2]
    assert all(torch.equal(again.get_parameter(n).bfloat16(), want.model.get_parameter(n)) for n in weights)
    assert not any(torch.equal(again.get_parameter(n), other.get_parameter(n)) for n in weights)
    # every parameter set by transformers' init: normal weights have the config's std, none is left NaN
    assert all(bool(p.isfinite().all()) for p in again.parameters())
    std = preset_config(name).initializer_range
    emb = again.get_input_embeddings().weight.detach()
    assert float(emb.std()) == pytest.approx(std, rel=0.05)


def test_preset_parameter_no_init_sets_is_an_error(monkeypatch):
    """A parameter transformers' `_init_weights` leaves alone would be uninitialised memory: a ModelError instead."""
    config = preset_config("tiny-qwen3_5", vocab_size=300)
    cls = next(c for c in type(skeleton(config)).__mro__ if "_init_weights" in c.__dict__)  # the family's
    original = cls._init_weights

    def skip_norms(self, module):
        if "RMSNorm" not in type(module).__name__:
            original(self, module)

    monkeypatch.setattr(cls, "_init_weights", skip_norms)
    model = skeleton(config)
    model.to_empty(device="cpu")
    model.tie_weights()
    with pytest.raises(ModelError, match=r"left parameter '.*norm.weight' unset"):
        fill(model, PresetReader(config, 0))


def test_checkpoint_reader_reads_rows_and_fuses_experts(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3_next", seed=2)
    saved = read_tensors(path)
    reader = CheckpointReader(path)
    try:
        assert torch.equal(reader("model.embed_tokens.weight", 3, 10), saved["model.embed_tokens.weight"][3:10])
        plain = load_model(str(path)).model
        experts = "model.layers.1.mlp.experts"
        for which in ("gate_up_proj", "down_proj"):
            block = reader(f"{experts}.{which}", 1, 3)  # experts 1 and 2 of 4
            whole = getattr(plain.get_submodule(experts), which)
            assert torch.equal(block, whole[1:3]), which
            assert reader.saved(f"{experts}.{which}") == (torch.float32, tuple(whole.shape)), which
        assert reader.saved("model.norm.weight") == (torch.float32, (64,))
        assert reader.saved("model.nothing.weight") is None
        with pytest.raises(ModelError, match="no tensor for parameter 'model.nothing.weight'"):
            reader("model.nothing.weight", 0, 1)
    finally:
        reader.close()


def test_a_checkpoint_the_meta_path_cannot_name_loads_whole(tmp_path, caplog):
    """A parameter without a tensor of its name (keys only transformers' loading converts): the plain load, said."""
    from safetensors.torch import save_file

    path = make_checkpoint(tmp_path, "qwen3_5_text")
    tensors = read_tensors(path)
    tensors["model.norm.weight_renamed"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level("INFO", logger="hybridtune"):
        loaded = load_model(str(path), meta=True)
    assert loaded.reader is None and not any(p.is_meta for p in loaded.model.parameters())
    assert "loaded whole, not shard by shard: no tensor named 'model.norm.weight'" in caplog.text


def test_a_checkpoint_whose_shapes_differ_from_its_config_is_a_model_error(tmp_path):
    import json

    path = make_checkpoint(tmp_path, "qwen3_next")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_experts"] = 3  # the files hold 4 experts per layer
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ModelError,
        match=r"do not match its config.json \('model.layers.0.mlp.gate.weight' is \[4, 64\], .* \[3, 64\]\)",
    ):
        load_model(str(path), meta=True)
