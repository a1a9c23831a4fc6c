"""Under FSDP2 over 2 processes (torchrun, gloo, CPU), a model built on the meta device, sharded, and then filled rank
by rank (`engines.load_sharded`) equals the plain load, every parameter gathered whole, for a preset and for the
tiny checkpoints (text, vision-language with its frozen tower, MoE with per-expert files), per-layer and whole-model
units alike; each rank holds and stages less than the whole model. And the mixed precision FSDP2 runs under bf16 is
the stated one: fp32 sharded masters and gradients, bf16 gathered parameters in the forward and backward, fp32
gradient reductions.

One torchrun launch serves every check; each rank writes what it found to rank<k>.json.
"""

from __future__ import annotations

import os

import pytest
import torch
from torchrun_runs import launch_ranks

from checkpoints import make_checkpoint

RANKS = """
import dataclasses, json, logging, pathlib, sys, torch
from hybridtune.data import PackedCollator
from hybridtune.data.packing import Example
from hybridtune.models.anatomy import decoder_layers
from hybridtune.models.loading import load_model
from hybridtune.runtime import distributed, engines
from hybridtune.runtime.adapter_kind import FULL
from hybridtune.train.objectives import SFT
sys.path[:0] = [sys.argv[2], str(pathlib.Path(sys.argv[2]).parent)]  # this file, tests/checkpoints.py
from torchrun_runs import mismatches

OUT, SOURCES = pathlib.Path(sys.argv[1]), sys.argv[3:]
logging.basicConfig(level=logging.INFO)
d = distributed.init("fsdp", FULL, "cpu")
CPU = torch.device("cpu")

def compare(source, units):
    plain = load_model(source, seed=3, dtype=torch.float32).model
    loaded = load_model(source, seed=3, dtype=torch.float32, meta=True)
    engine = engines.wrap(distributed.LossModule(loaded.model, SFT(fused=True)), dataclasses.replace(d, units=units), CPU, False)
    assert all(p.is_meta for p in engine.parameters())
    records = engines.load_sharded(loaded, engine, d, CPU)
    want = dict(plain.named_parameters())
    got = {n.removeprefix("model."): p for n, p in engine.named_parameters()}
    bad = mismatches(want, got)
    buffers = [n for n, b in plain.named_buffers() if not torch.equal(b, loaded.model.get_buffer(n))]
    return {"bad": bad, "missing": sorted(set(want) ^ set(got)), "buffers": buffers, "records": records,
            "sharded": all(hasattr(p, "device_mesh") for p in engine.parameters())}

def mixed_precision():
    loaded = load_model("tiny-qwen3_5", seed=3, dtype=torch.float32, meta=True)
    engine = engines.wrap(distributed.LossModule(loaded.model, SFT(fused=True)), dataclasses.replace(d, units="layer"), CPU, True)
    engines.load_sharded(loaded, engine, d, CPU)
    seen = {}
    layer = decoder_layers(loaded.model)[1]
    def hook(module, args):
        seen["forward"] = sorted({str(p.dtype) for p in module.parameters(recurse=True)})
    layer.register_forward_pre_hook(hook)
    dtypes = {"gather": set(), "reduce": set()}
    dist = torch.distributed
    names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor",
             "all_reduce")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    for n, f in saved.items():
        def spy(*a, _f=f, _k="gather" if "gather" in n else "reduce", **kw):
            dtypes[_k].update(str(t.dtype) for t in (*a, *kw.values()) if isinstance(t, torch.Tensor))
            return _f(*a, **kw)
        setattr(dist, n, spy)
    sizes = [(40, 23), (30, 9)][d.rank]
    batch = PackedCollator()([Example(list(range(5, 5 + n)), [1] * n) for n in sizes])
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = engine(batch, 100)
        (loss * d.world).backward()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    params = [p for p in engine.parameters() if p.requires_grad]
    return {
        "forward": seen["forward"],
        "sharded": sorted({str(p.dtype) for p in params}),
        "grads": sorted({str(p.grad.dtype) for p in params if p.grad is not None}),
        "with_grad": sum(p.grad is not None for p in params), "trainable": len(params),
        "gather": sorted(dtypes["gather"]), "reduce": sorted(dtypes["reduce"]),
    }

def groups():
    # One window of 2 micro-batches per rank under DDP, FSDP2 per layer and FSDP2 in groups of 2 and 3 layers (of 4):
    # the whole gradient of each, and the all-gathers per micro-batch.
    out = {}
    for key, dd in [("ddp", dataclasses.replace(d, engine="ddp")), ("layer", dataclasses.replace(d, units="layer")),
                    ("group:2", dataclasses.replace(d, units="group:2")),
                    ("group:3", dataclasses.replace(d, units="group:3"))]:
        torch.manual_seed(0)
        loaded = load_model("tiny-qwen3_5", seed=3, meta=True)
        engine = engines.wrap(distributed.LossModule(loaded.model, SFT(fused=True)), dd, CPU, False, loaded)
        gathers = [0]
        dist = torch.distributed
        name = next(n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n))
        saved = getattr(dist, name)
        def spy(*a, **kw):
            gathers[0] += 1
            return saved(*a, **kw)
        setattr(dist, name, spy)
        losses = []
        try:
            for sizes in [(65, 23), (40, 23, 9), (90, 30), (12, 7, 50)][d.rank :: d.world]:
                batch = PackedCollator()([Example(list(range(5, 5 + n)), [1] * n) for n in sizes])
                with engines.accumulation(engine, dd, last=len(losses) == 1):
                    loss = engine(batch, 300)
                    (loss * d.world).backward()
                losses.append(float(loss))
        finally:
            setattr(dist, name, saved)
        grads = {}
        for n, p in engine.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            grads[n.removeprefix("module.")] = g.detach().flatten()
        out[key] = {"losses": losses, "gathers_per_micro_batch": gathers[0] / 2, "grads": grads}
    ref = out["ddp"]["grads"]
    for key in ("layer", "group:2", "group:3"):
        g = out[key].pop("grads")
        out[key]["keys"] = sorted(g) == sorted(ref)
        out[key]["grad_rel_diff"] = max(
            float((g[n] - r).abs().max() / r.abs().max().clamp(min=1e-30)) for n, r in ref.items())
    out["ddp"].pop("grads")
    return out

got = {"load": {f"{s}|{u}": compare(s, u) for s in SOURCES for u in ("layer", "model")}, "mp": mixed_precision(),
       "groups": groups()}
(OUT / f"rank{d.rank}.json").write_text(json.dumps(got))
distributed.shutdown(d)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("meta_ranks")
    sources = ["tiny-qwen3_5", "tiny-qwen3_next"]
    sources += [str(make_checkpoint(out, k, torch.float32)) for k in ("qwen3_5_text", "qwen3_5_vl", "qwen3_next")]
    sources.append(str(make_checkpoint(out, "qwen3_5_moe_vl", torch.bfloat16)))  # bf16 files, fp32 masters
    return launch_ranks(out, RANKS, [str(out), os.path.dirname(os.path.abspath(__file__)), *sources])


@pytest.mark.slow
@pytest.mark.torchrun
def test_meta_init_and_sharded_load_equal_the_plain_load(ranks):
    for rank in ranks:
        assert len(rank["load"]) == 12
        for key, res in rank["load"].items():
            assert res["sharded"], key
            assert res["bad"] == [] and res["missing"] == [] and res["buffers"] == [], key


@pytest.mark.slow
@pytest.mark.torchrun
def test_each_rank_holds_and_stages_less_than_the_whole_model(ranks):
    """The two ranks' parts add up to the model (disjoint shards, nothing held twice); each is about half of it; the
    largest block staged on the host (a slice read, or one block of a preset's init) is far from the whole."""
    for key, res in ranks[0]["load"].items():
        records = res["records"]
        assert [r["rank"] for r in records] == [0, 1]
        model = records[0]["model_bytes"]
        assert sum(r["local_bytes"] for r in records) == model, key
        for r in records:
            assert r["local_bytes"] <= 0.6 * model, (key, r)
            assert 0 < r["staged_bytes"] <= 0.5 * model, (key, r)
            assert r["host_peak_bytes"] > 0 and r["gpu_peak_bytes"] == 0, (key, r)


@pytest.mark.slow
@pytest.mark.torchrun
def test_fsdp2_mixed_precision_is_bf16_compute_fp32_masters_and_reductions(ranks):
    mp = ranks[0]["mp"]
    assert mp["forward"] == ["torch.bfloat16"], mp  # a layer's parameters as its forward sees them: gathered bf16
    assert mp["sharded"] == ["torch.float32"] and mp["grads"] == ["torch.float32"], mp  # masters, their gradients
    assert mp["with_grad"] == mp["trainable"], mp
    assert mp["gather"] == ["torch.bfloat16"], mp  # the all-gathers carry bf16
    assert "torch.float32" in mp["reduce"] and "torch.bfloat16" not in mp["reduce"], mp  # reductions in fp32


@pytest.mark.slow
@pytest.mark.torchrun
def test_fsdp2_layer_groups_train_what_ddp_trains_with_one_gather_per_group(ranks):
    """`group:K` units: K consecutive layers gathered and reduced together, and the window's gradient is DDP's, element
    by element (tolerance of test_distributed: only the order of fp32 sums differs). All-gathers per micro-batch, 4
    layers: per layer 4 + the root's in the forward, the 4 again in the backward (the root stays gathered); in groups
    of 2 (or of 3 and 1) 2 + 1 and 2."""
    res = ranks[0]["groups"]
    assert res["layer"]["gathers_per_micro_batch"] == 9, res
    assert res["group:2"]["gathers_per_micro_batch"] == 5, res
    assert res["group:3"]["gathers_per_micro_batch"] == 5, res
    for key in ("layer", "group:2", "group:3"):
        assert res[key]["keys"], key
        assert res[key]["losses"] == pytest.approx(res["ddp"]["losses"], rel=1e-6), (key, res)
        assert res[key]["grad_rel_diff"] < 1e-4, (key, res)


def test_layer_group_units_are_checked():
    from hybridtune.errors import ConfigError
    from hybridtune.runtime.engines import layer_groups

    assert layer_groups(list(range(7)), "group:3") == [[0, 1, 2], [3, 4, 5], [6]]
    assert layer_groups(list(range(3)), "group:1") == layer_groups(list(range(3)), "layer") == [[0], [1], [2]]
    assert layer_groups(list(range(3)), "group:9") == [[0, 1, 2]]
    for bad in ("group:0", "group:", "group:x", "groups:2", "layers"):
        with pytest.raises(ConfigError, match="use layer, model or group:K"):
            layer_groups([0], bad)


def test_wrap_fills_a_meta_built_model_whole_in_one_process():
    """Off FSDP2 (one process here; DDP likewise) `wrap` gives a meta-built model its values whole, as loaded plainly."""
    from hybridtune.models.loading import load_model
    from hybridtune.runtime import distributed, engines
    from hybridtune.train.objectives import SFT

    want = load_model("tiny-qwen3_5", seed=4).model
    loaded = load_model("tiny-qwen3_5", seed=4, meta=True)
    engine = engines.wrap(
        distributed.LossModule(loaded.model, SFT(fused=True)), distributed.ONE, torch.device("cpu"), False, loaded
    )
    assert loaded.reader is None and engine.model is loaded.model
    got = dict(loaded.model.named_parameters())
    assert got.keys() == dict(want.named_parameters()).keys()
    assert all(torch.equal(got[n], p) for n, p in want.named_parameters())
    assert loaded.model.lm_head.weight is loaded.model.get_input_embeddings().weight  # still tied
