"""`fsdp_units: auto` below the whole-model unit: the most consecutive decoder layers per FSDP2 unit whose step fits
the GPU's free memory (runtime/memory.py: the rank's shards, the root unit, two gathered groups and one group's
gradient, plus the activation estimate at the run's checkpointing), stated with the figures; one layer each when
nothing larger fits or nothing can be estimated; explicit units kept; the whole model under the loop when it fits.
The 9B shape (preset qwen3_5-9b, built on the meta device) is a full fine-tune on 2 GPUs of 139 GiB."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.models.presets import preset_config
from hybridtune.runtime import distributed, engines
from hybridtune.runtime.choices import Facts, choose_checkpointing, least_units, resolve
from hybridtune.runtime.measure import measure
from hybridtune.runtime.memory import FIT_SHARE, GIB, ActivationShapes, ShardedModel, fsdp_group, step_bytes

TOTAL = 139 * GIB  # an H200
FREE = 138 * GIB  # ... with a meta-built model (nothing resident yet) and the CUDA context


@pytest.fixture(scope="module")
def nine_b():
    from transformers import AutoModelForCausalLM

    config = preset_config("qwen3_5-9b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return model, ActivationShapes.of(config)


def _facts(nine_b, free: int = FREE, **kw) -> Facts:
    model, shapes = nine_b
    whole = engines.whole_model_bytes(model, 2, True)
    base = dict(
        device="cuda",
        bf16_supported=True,
        engine="fsdp",
        world=2,
        whole_model_share=whole / TOTAL,
        gpu_free_bytes=free,
        state_bytes=whole,  # what `measure.state_bytes` measures of a meta-built model under FSDP2
        shapes=shapes,
        sharded=ShardedModel.of(model, 2, True),
    )
    return Facts(**{**base, **kw})


def _cfg(**over):
    return load_config(None, {"sequence_len": 4096, "adapter": "full", **over})


def test_9b_full_fine_tune_on_two_h200s_takes_groups_of_layers(nine_b):
    facts = _facts(nine_b)
    assert facts.whole_model_share > 0.9  # the whole model as one unit: no room for activations
    c = resolve(_cfg(), facts)
    assert c.compile.value == "modules" and "auto -> layer or group:K" in c.compile.reason
    assert c.checkpointing.value is False  # 4096 tokens fit without it, even beside one layer per unit
    units = c.fsdp_units.value
    assert units.startswith("group:"), c.fsdp_units.reason
    k = int(units.split(":")[1])
    assert 1 < k < 32
    need = step_bytes(facts.shapes, 4096, bf16=True, fused_loss=True, state_bytes=facts.sharded.state_bytes(k))
    assert need.without <= FIT_SHARE * FREE
    assert c.fsdp_units.reason.startswith("auto: the whole model as one FSDP2 unit needs 96% of the smallest GPU")
    assert c.fsdp_units.reason.endswith(
        f"; {k} layers per unit: about {need.without / GIB:.1f} GiB of the 138.0 GiB free per GPU "
        "(without checkpointing)"
    )
    # The largest: fewer units (more layers each) would not fit.
    fewer = -(-32 // (-(-32 // k) - 1))
    more = step_bytes(facts.shapes, 4096, bf16=True, fused_loss=True, state_bytes=facts.sharded.state_bytes(fewer))
    assert more.without > FIT_SHARE * FREE
    assert f"fsdp_units: {units} (auto: " in "\n".join(c.lines())


def test_a_smaller_gpu_takes_fewer_layers_per_unit_and_a_tiny_one_one_layer(nine_b):
    def k(free, **over):
        units = resolve(_cfg(**over), _facts(nine_b, free)).fsdp_units
        return (1 if units.value == "layer" else int(units.value.split(":")[1])), units.reason

    big, _ = k(FREE)
    smaller, _ = k(128 * GIB)
    assert 1 < smaller < big
    # With checkpointing (longer packs), the units grow with the memory too.
    assert 1 < k(104 * GIB, sequence_len=8192)[0] < k(124 * GIB, sequence_len=8192)[0]
    one, reason = k(80 * GIB)
    assert one == 1 and "; 1 layer per unit: about " in reason and "(with checkpointing), 2 would need " in reason


def test_explicit_units_are_kept_and_a_whole_model_that_fits_stays_one_unit_under_the_loop(nine_b):
    for units in ("layer", "group:4", "group:31"):
        c = resolve(_cfg(fsdp_units=units), _facts(nine_b))
        assert (c.fsdp_units.value, c.fsdp_units.reason) == (units, f"fsdp_units: {units}")
        assert c.compile.value == "modules"
    # 2 GPUs large enough for the whole unit: the compiled loop, and the model as one unit.
    roomy = _facts(nine_b, free=400 * GIB, whole_model_share=0.5)
    c = resolve(_cfg(), roomy)
    assert (c.compile.value, c.fsdp_units.value) == ("loop", "model")
    assert c.fsdp_units.reason == "auto: the compiled loop is one graph over every layer"
    # compile modules with the whole model fitting: units from the memory all the same
    c = resolve(_cfg(compile="modules"), roomy)
    assert (
        c.fsdp_units.value == "group:16" and "compile modules leaves the layers to FSDP2's hooks" in c.fsdp_units.reason
    )


def test_without_gpu_memory_to_plan_for_the_units_are_layers(nine_b):
    cpu = _facts(nine_b, device="cpu", bf16_supported=False, whole_model_share=None, gpu_free_bytes=None)
    c = resolve(_cfg(), cpu)
    assert c.compile.value == "off" and c.fsdp_units.value == "layer"
    assert c.fsdp_units.reason == (
        "auto: compile off leaves the layers to FSDP2's hooks; no GPU memory to plan larger units for "
        "(fsdp_units: auto -> layer)"
    )
    assert resolve(_cfg(), _facts(nine_b, engine="ddp")).fsdp_units.value is None


def test_checkpointing_is_estimated_on_the_least_units(nine_b):
    """Checkpointing is decided before the units, beside the state of the least units the run gets: one layer each
    under auto below the loop, the explicit ones, the whole model for `model` (which holds it gathered)."""
    facts = _facts(nine_b)
    cfg = _cfg()
    assert least_units(cfg, facts, "modules") == 1 and least_units(cfg, facts, "loop") is None
    assert least_units(_cfg(fsdp_units="group:6"), facts, "modules") == 6
    assert least_units(_cfg(fsdp_units="model"), facts, "modules") is None
    assert least_units(cfg, dataclasses.replace(facts, engine="ddp"), "loop") is None
    off = choose_checkpointing(cfg, facts, None, True, True, units=1)
    on = choose_checkpointing(cfg, facts, None, True, True)  # the whole-model unit's state
    assert off.value is False and on.value is True
    assert resolve(_cfg(fsdp_units="model", compile="modules"), facts).checkpointing.value is True
    assert resolve(_cfg(fsdp_units="layer"), facts).checkpointing.value is False


def test_sharded_model_counts_shards_root_and_layers():
    from hybridtune.models.anatomy import decoder_layers
    from hybridtune.models.loading import load_model

    model = load_model("tiny-qwen3_5").model  # fp32, all trainable, lm_head tied to the embeddings (counted once)
    n = sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in decoder_layers(model)]
    root = n - sum(per_layer)
    s = ShardedModel.of(model, 2, bf16=True)
    assert s.shards == n * 16 // 2 and s.root == root * (2 + 2 + 4) and s.resident == n * 4
    assert s.layers == tuple((m * 2, m * (2 + 4)) for m in per_layer)
    fp32 = ShardedModel.of(model, 2, bf16=False)
    assert fp32.root == root * (4 + 4 + 4) and fp32.layers[0] == (per_layer[0] * 4, per_layer[0] * 8)
    big = max(per_layer[i] + per_layer[i + 1] for i in range(0, len(per_layer) - 1, 2))
    assert s.state_bytes(2) == s.shards + s.root + 2 * big * 2 + big * 6 - s.resident
    with torch.device("meta"):  # a meta-built model holds none of it yet
        meta = type(model)(model.config)
    assert ShardedModel.of(meta, 2, True).resident == 0


def test_measure_reads_the_sharded_model_under_fsdp2_only():
    from hybridtune.models.loading import load_model

    model = load_model("tiny-qwen3_5").model
    cfg = load_config(None, {"adapter": "full"})
    fsdp = distributed.Dist(rank=0, world=2, engine="fsdp")
    facts = measure(cfg, torch.device("cpu"), fsdp, model, bf16=False)
    assert facts.sharded == ShardedModel.of(model, 2, False) and facts.gpu_free_bytes is None
    assert measure(cfg, torch.device("cpu"), dataclasses.replace(fsdp, engine="ddp"), model).sharded is None


def test_the_group_size_is_evened_out_to_as_few_units():
    """32 equal layers, room for 20 per unit: 2 units either way, so 16 each (less memory, balanced prefetch)."""
    shapes = ActivationShapes.of(preset_config("qwen3_5-9b"))
    sharded = ShardedModel(shards=0, root=0, layers=((GIB, GIB),) * 32, resident=0)

    def room_for(k):  # the free memory where exactly k layers per unit fit
        est = step_bytes(shapes, 1024, bf16=True, fused_loss=True, state_bytes=sharded.state_bytes(k))
        return int(est.without / FIT_SHARE) + 1

    fit = fsdp_group(sharded, shapes, 1024, bf16=True, fused_loss=True, checkpointing=False, available=room_for(20))
    assert (
        fit.k == 16
        and fit.need
        == step_bytes(shapes, 1024, bf16=True, fused_loss=True, state_bytes=sharded.state_bytes(16)).without
    )
    assert (
        fsdp_group(sharded, shapes, 1024, bf16=True, fused_loss=True, checkpointing=False, available=room_for(11)).k
        == 11
    )
    tight = fsdp_group(sharded, shapes, 1024, bf16=True, fused_loss=True, checkpointing=False, available=GIB)
    assert (tight.k, tight.over is not None) == (1, True)
    two = ShardedModel(shards=0, root=0, layers=((GIB, GIB),) * 2, resident=0)
    assert fsdp_group(two, shapes, 1024, bf16=True, fused_loss=True, checkpointing=False, available=10**15).k == 1
