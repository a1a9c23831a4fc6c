"""LoRA on a base built on the meta device (what a LoRA run under FSDP2 builds, `train.model.build_model`), filled
after: every parameter, base and adapter, equals the plain LoRA build's under the same seed, bit for bit, for the
presets (their seeded draw) and for each checkpoint kind (the frozen vision tower as saved, experts with LoRA on their
fused weights). The frozen base keeps its dtype (bf16 when bf16 computes), the adapter is fp32, drawn by peft as the
plain build draws it. The sharded case (FSDP2 over 2 processes) is the slow tier below and tests/runtime/
test_distributed.py's loss curves."""

from __future__ import annotations

import os

import pytest
import torch
from torchrun_runs import launch_ranks

from checkpoints import KINDS, MOE_KINDS, make_checkpoint
from hybridtune.config import load_config
from hybridtune.models.loading import materialize, resolve_source, tokenizer_for
from hybridtune.runtime import distributed, engines
from hybridtune.runtime.distributed import ONE, Dist
from hybridtune.runtime.lora import AdaptersOnHost, strip_base_layer
from hybridtune.runtime.measure import state_bytes
from hybridtune.runtime.memory import ShardedModel
from hybridtune.runtime.model import build_model

CPU = torch.device("cpu")
MOE_PARAMETERS = ["gate_up_proj", "down_proj"]


def lora_cfg(base: str, moe: bool = False, **kw):
    extra = {"lora_target_parameters": MOE_PARAMETERS, "lora_dropout": 0} if moe else {}
    return load_config(None, {"base_model": base, "adapter": "lora", "lora_r": 4, "seed": 9, **extra, **kw})


def build(cfg, bf16: bool, dist: Dist):
    """`build_model` as the trainer calls it: the run's seed set just before (train/trainer.py)."""
    source = resolve_source(cfg.base_model)
    torch.manual_seed(cfg.seed)
    return build_model(cfg, source, tokenizer_for(source), CPU, bf16, dist)


def assert_same_lora(got: torch.nn.Module, want: torch.nn.Module) -> None:
    g, w = dict(got.named_parameters(remove_duplicate=False)), dict(want.named_parameters(remove_duplicate=False))
    assert g.keys() == w.keys()
    assert any("lora_A" in n for n in w) and any("lora_B" in n for n in w)
    for name in w:
        assert (g[name].dtype, g[name].requires_grad) == (w[name].dtype, w[name].requires_grad), name
        assert torch.equal(g[name], w[name]), name
    assert [n for n, _ in got.named_parameters()] == [n for n, _ in want.named_parameters()]  # tying kept
    gb, wb = dict(got.named_buffers()), dict(want.named_buffers())
    assert gb.keys() == wb.keys() and all(torch.equal(gb[k], wb[k]) for k in wb)


def meta_and_plain(cfg, bf16: bool):
    plain = build(cfg, bf16, ONE)
    meta = build(cfg, bf16, Dist(engine="fsdp"))
    assert plain.loaded.reader is None
    assert meta.loaded.reader is not None, "LoRA under FSDP2 is built on the meta device"
    base = [n for n, p in meta.model.named_parameters() if not p.requires_grad]
    adapter = [n for n, p in meta.model.named_parameters() if p.requires_grad]
    assert base and all(meta.model.get_parameter(n).is_meta for n in base)  # no rank holds the base before sharding
    assert adapter and all("lora_" in n for n in adapter)
    stats = materialize(meta.loaded, meta.loaded.model, CPU)
    return meta, plain, stats


@pytest.mark.parametrize("name", ["tiny-qwen3_5", "tiny-qwen3_next"])
@pytest.mark.parametrize("bf16", [True, False])
def test_preset_meta_lora_equals_plain_lora(name, bf16):
    meta, plain, stats = meta_and_plain(lora_cfg(name, moe=name.endswith("next")), bf16)
    assert_same_lora(meta.model, plain.model)
    base_dtype = torch.bfloat16 if bf16 else torch.float32
    for n, p in meta.model.named_parameters():
        assert p.dtype == (torch.float32 if p.requires_grad else base_dtype), n  # adapters fp32, base held_dtype
    assert stats.local_bytes == stats.model_bytes == sum(p.numel() * p.element_size() for p in plain.model.parameters())
    assert 0 < stats.staged_bytes <= 0.5 * stats.model_bytes  # about one block of the preset's init at a time
    # the adapter is peft's own init: lora_B zeros, lora_A drawn (not zeros, not NaN)
    for n, p in meta.model.named_parameters():
        if "lora_B" in n:
            assert not p.any(), n
        elif "lora_A" in n:
            assert p.isfinite().all() and p.any(), n


@pytest.mark.parametrize("kind", KINDS)
def test_checkpoint_meta_lora_equals_plain_lora(tmp_path, kind):
    path = make_checkpoint(tmp_path, kind, torch.bfloat16, seed=5)
    meta, plain, _ = meta_and_plain(lora_cfg(str(path), moe=kind in MOE_KINDS), bf16=True)
    assert_same_lora(meta.model, plain.model)


def test_loading_a_checkpoint_leaves_the_runs_random_state_alone(tmp_path):
    """transformers' init of a loaded Qwen3.5 still draws (its A_log init), which a meta build cannot repeat: the
    plain load runs it on a forked generator, so the adapter is peft's draw right after the run's seed either way."""
    from hybridtune.models.loading import load_model

    path = make_checkpoint(tmp_path, "qwen3_5_text", seed=5)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    load_model(str(path), dtype=torch.bfloat16)
    assert torch.equal(torch.get_rng_state(), before)


def test_strip_base_layer():
    assert strip_base_layer("model.layers.0.mlp.experts.base_layer.base_layer.gate_up_proj") == (
        "model.layers.0.mlp.experts.gate_up_proj"
    )
    assert (
        strip_base_layer("model.layers.0.self_attn.q_proj.base_layer.weight")
        == "model.layers.0.self_attn.q_proj.weight"
    )
    assert strip_base_layer("model.norm.weight") == "model.norm.weight"


# -- FSDP2 over 2 processes (torchrun, gloo, CPU) ------------------------------------------------------------------


RANKS = """
import json, logging, pathlib, sys, torch
sys.path[:0] = [sys.argv[2], str(pathlib.Path(sys.argv[2]).parent)]  # this file, tests/checkpoints.py
from test_lora_meta import build, lora_cfg
from torchrun_runs import mismatches
from hybridtune.runtime import distributed, engines
from hybridtune.runtime.adapter_kind import LORA
from hybridtune.train.objectives import SFT
from hybridtune.runtime.distributed import ONE

OUT, SOURCES = pathlib.Path(sys.argv[1]), sys.argv[3:]
logging.basicConfig(level=logging.INFO)
d = distributed.init("fsdp", LORA, "cpu")
CPU = torch.device("cpu")

def compare(source):
    cfg = lora_cfg(source, moe="next" in source or "moe" in source)
    plain = build(cfg, True, ONE).model
    built = build(cfg, True, d)
    engine = engines.wrap(distributed.LossModule(built.model, SFT(fused=True)), d, CPU, True)
    assert all(p.is_meta for n, p in engine.named_parameters() if not p.requires_grad)
    records = engines.load_sharded(built.loaded, engine, d, CPU)
    want = dict(plain.named_parameters())
    got = {n.removeprefix("model."): p for n, p in engine.named_parameters()}
    bad = mismatches(want, got)
    base = [p for p in engine.parameters() if not p.requires_grad]
    return {
        "bad": bad, "missing": sorted(set(want) ^ set(got)), "records": records,
        "sharded": all(hasattr(p, "device_mesh") for p in engine.parameters()),
        "base_local_bytes": sum(p.to_local().numel() * p.element_size() for p in base),
        "base_bytes": sum(p.numel() * p.element_size() for p in base),
        "base_dtypes": sorted({str(p.dtype) for p in base}),
        "adapter_dtypes": sorted({str(p.dtype) for p in engine.parameters() if p.requires_grad}),
    }

(OUT / f"rank{d.rank}.json").write_text(json.dumps({s: compare(s) for s in SOURCES}))
distributed.shutdown(d)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("lora_meta_ranks")
    sources = ["tiny-qwen3_5", "tiny-qwen3_next"]
    sources += [str(make_checkpoint(out, k, torch.bfloat16)) for k in ("qwen3_5_vl", "qwen3_next")]
    here = os.path.dirname(os.path.abspath(__file__))
    return launch_ranks(out, RANKS, [str(out), here, *sources])


@pytest.mark.slow
@pytest.mark.torchrun
def test_sharded_meta_lora_equals_the_plain_lora_build(ranks):
    for rank in ranks:
        assert len(rank) == 4
        for source, res in rank.items():
            assert res["sharded"], source
            assert res["bad"] == [] and res["missing"] == [], source
            assert res["base_dtypes"] == ["torch.bfloat16"] and res["adapter_dtypes"] == ["torch.float32"], source


@pytest.mark.slow
@pytest.mark.torchrun
def test_each_rank_holds_part_of_the_base(ranks):
    """Each rank's shards of the frozen base are about half of it and the two add up to it; the largest block
    staged on the host is far from the whole model."""
    for source in ranks[0]:
        parts = [rank[source]["base_local_bytes"] for rank in ranks]
        whole = ranks[0][source]["base_bytes"]
        assert sum(parts) == whole, source
        assert all(0 < b <= 0.6 * whole for b in parts), (source, parts, whole)
        for r in ranks[0][source]["records"]:
            assert r["local_bytes"] <= 0.6 * r["model_bytes"], (source, r)
            assert 0 < r["staged_bytes"] <= 0.5 * r["model_bytes"], (source, r)
            assert r["host_peak_bytes"] > 0, (source, r)


def test_a_meta_built_lora_counts_nothing_resident_on_the_gpu():
    """Under FSDP2 a LoRA run's base is on the meta device and its adapter, drawn by peft, on the host: the fill
    after `fully_shard` writes both anew as shards on the GPU, so none of it is already allocated there (the
    adapter is not to be taken off the estimate of what FSDP2 holds)."""
    cfg = load_config(None, {"base_model": "tiny-qwen3_5", "adapter": "lora", "lora_r": 4})
    source = resolve_source(cfg.base_model)
    fsdp = distributed.Dist(rank=0, world=2, engine="fsdp")
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, source, tokenizer_for(source), CPU, True, fsdp).model
    assert any(p.is_meta for p in model.parameters()) and any(not p.is_meta for p in model.parameters())
    assert ShardedModel.of(model, 2, True).resident == 0
    assert state_bytes(model, fsdp, True) == engines.whole_model_bytes(model, 2, True)


def test_adapters_on_host_leaves_other_moves_as_to_makes_them():
    """`lora.AdaptersOnHost` keeps a move onto the meta device on the host (the dtype cast alone); every other
    `Tensor.to` call, `copy=True` among them, does what it does outside the mode."""
    t = torch.randn(3)
    with AdaptersOnHost():
        to_cpu = t.to("cpu", copy=True)
        to_meta = t.to("meta", copy=True)
        cast = t.to(torch.device("meta"), torch.bfloat16, non_blocking=True)
        kept = t.to("meta")
    assert to_cpu is not t and torch.equal(to_cpu, t)
    assert to_meta is not t and to_meta.device.type == "cpu" and torch.equal(to_meta, t)
    assert cast.device.type == "cpu" and cast.dtype == torch.bfloat16 and torch.equal(cast, t.bfloat16())
    assert kept.device.type == "cpu" and torch.equal(kept, t)
