"""The mixer seam: a toy mixer (conftest.py) registered from the test through `hybridtune.mixers.register` only is
routed by patch_model, fed its metadata by the collator, trains through the runtime's step (`LossModule` over the
SFT objective, whose `model_inputs` pass the registry's keys), compiles with no graph break, is counted by the FLOP
model and the memory estimate, and shows in the kernel path report (what `doctor` prints)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from toy_spec import DOC_IDS, KIND, toy_recurrence, toy_reference

import hybridtune
from hybridtune.batch import NUM_LOSS_TOKENS
from hybridtune.data.collator import PackedCollator
from hybridtune.data.packing import Example
from hybridtune.kernels.paths import report as path_report
from hybridtune.mixers import MIXERS, registry
from hybridtune.models.flops import step_flops
from hybridtune.models.patching import patch_model
from hybridtune.models.presets import preset_config
from hybridtune.runtime.distributed import LossModule
from hybridtune.runtime.memory import ActivationShapes, step_bytes
from hybridtune.runtime.step import model_inputs
from hybridtune.train.objectives.sft import SFT

LENS = [5, 9, 3, 15]


def _model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config("tiny-qwen3_5", vocab_size=256)).float()


def _batch():
    gen = torch.Generator().manual_seed(0)
    docs = [Example(torch.randint(1, 256, (n,), generator=gen).tolist(), [1] * n) for n in LENS]
    return PackedCollator()(docs)


def test_closed_form_is_the_recurrence():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 20, 2, 3, generator=gen)
    log_a = torch.nn.functional.logsigmoid(torch.randn(1, 20, 2, generator=gen))
    b = torch.rand(1, 20, 2, generator=gen)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 1, 12]))
    torch.testing.assert_close(toy_recurrence(x, log_a, b, ids), toy_reference(x, log_a, b, ids))


def test_registered_only_through_the_public_api(toy_mixer):
    assert MIXERS[KIND] is toy_mixer and next(iter(MIXERS)) == KIND
    src = Path(hybridtune.__file__).parent
    assert not [p for p in src.rglob("*.py") if DOC_IDS in p.read_text() or "toy_recurrence" in p.read_text()]


def test_routed_collated_and_trained(toy_mixer):
    model = _model()
    rep = patch_model(model)
    assert rep.num_routed == 3 and all(p == "toy -> pure torch" for p in rep.routed.values()), rep.routed
    batch = _batch()
    assert batch[DOC_IDS].tolist() == [d for d, n in enumerate(LENS) for _ in range(n)]
    assert DOC_IDS in model_inputs(batch) and DOC_IDS in registry.dynamic_keys()
    engine = LossModule(model, SFT(fused=True))  # what train's step calls (DDP / FSDP2 wrap this module)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = engine(batch, batch[NUM_LOSS_TOKENS])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses
    # the toy's weights learn: its projections get gradients through the recurrence
    layer = next(m for m in model.modules() if getattr(m, registry.MIXER_ATTR, None) == KIND)
    engine(batch, batch[NUM_LOSS_TOKENS]).backward()
    assert layer.in_proj_a.weight.grad.abs().sum() > 0 and layer.in_proj_z.weight.grad.abs().sum() > 0


def test_compiles_with_no_graph_break(toy_mixer):
    from torch._dynamo.utils import counters

    from hybridtune.compiler.loop import compile_loop

    torch._dynamo.reset()
    model = _model().train()
    batch = _batch()
    eager = model(**model_inputs(batch)).loss.detach()  # unpatched: GDN reference; patched below: the toy
    compile_loop(model, backend="aot_eager")
    counters.clear()
    loss = model(**model_inputs(batch)).loss
    loss.backward()
    assert dict(counters["graph_break"]) == {}
    assert torch.isfinite(loss) and not torch.equal(loss.detach(), eager)
    torch._dynamo.reset()


def _config(value_head_dim: int):
    cfg = preset_config("tiny-qwen3_5", vocab_size=256)
    cfg.linear_value_head_dim = value_head_dim
    return cfg


def test_counted_by_the_flop_model_and_the_memory_estimate(toy_mixer):
    narrow, wide = _config(32), _config(64)
    f_narrow, f_wide = step_flops(narrow, LENS).breakdown, step_flops(wide, LENS).breakdown
    assert 0 < f_narrow["toy_core"] < f_wide["toy_core"]
    assert f_narrow["gdn_core"] == 0.0  # the toy took the linear-attention layers' place
    s_narrow, s_wide = ActivationShapes.of(narrow), ActivationShapes.of(wide)
    assert s_narrow.widths("linear_attention") == toy_mixer.activations(narrow)
    assert 0 < s_narrow.layer_elements("linear_attention") < s_wide.layer_elements("linear_attention")
    est = [step_bytes(s, 4096, bf16=True, fused_loss=True, state_bytes=0) for s in (s_narrow, s_wide)]
    assert est[0].without < est[1].without and est[0].keeping_cores < est[1].keeping_cores


def test_shows_in_the_path_report(toy_mixer):
    model = _model()
    patch_model(model)
    rows = [m for m in path_report(model).mixers if m.note == f"mixer {KIND}"]
    assert len(rows) == 3 and all(r.path == "hybridtune op -> toy recurrence (pure torch)" for r in rows)
    assert not any(r.fast for r in rows)


@pytest.fixture(autouse=True)
def _registry_restored():
    before = list(MIXERS)
    yield
    assert list(MIXERS) == before  # the toy fixture removes what it registered


def test_graph_setup_runs_every_mixers_hook_and_one_undo(toy_mixer):
    """`registry.graph_setup` (what CUDA graphs, the loop and the bench call) reaches a registered mixer's hook, checks
    an `option=form` against the mixers' forms, and undoes every mixer's settings in reverse order."""
    calls = []

    def setup(what):
        calls.append(what)
        return lambda: calls.append(f"undo {what}")

    spec = dataclasses.replace(toy_mixer, graph_setup=setup, graph_forms={"toy_form": ("a", "b")})
    registry.register(spec, replace=True)
    assert registry.graph_forms()["toy_form"] == ("a", "b") and "conv" in registry.graph_forms()
    undo = registry.graph_setup(registry.CUDA_GRAPHS)
    assert calls == [registry.CUDA_GRAPHS]
    undo()
    assert calls[-1] == f"undo {registry.CUDA_GRAPHS}"
    with pytest.raises(ValueError, match=r"toy_form takes a\|b"):
        registry.graph_setup("toy_form=c")
    registry.graph_setup("toy_form=b")()
    assert calls[-2:] == ["toy_form=b", "undo toy_form=b"]
