"""`cuda_graphs: auto | on | off` (choices.choose_cuda_graphs): on for one process running the compiled loop on a GPU
over a static pack layout whose packs need at most MAX_CUDA_GRAPHS graphs; off otherwise with the reason in its
choice line; an explicit `on` where it cannot run is one ConfigError line. The bound is the number of distinct GDN
chunk counts the collator produces under the layout (checked against the collator itself)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from hybridtune.config import load_config
from hybridtune.data.collator import PackedCollator, StaticLayout
from hybridtune.data.packing import Example
from hybridtune.errors import ConfigError
from hybridtune.mixers import registry
from hybridtune.runtime import choices
from hybridtune.runtime.choices import Facts, choose_cuda_graphs, cuda_graph_keys

PACKS = ((100, 30), (64,), (200,), (7, 7, 7))


def _layout(packs=PACKS) -> StaticLayout:
    return StaticLayout.fit([list(p) for p in packs], max_filler=1.0)


def _facts(**kw) -> Facts:
    return Facts(**{"device": "cuda", "bf16_supported": True, "packs": PACKS, **kw})


def _cfg(**kw):
    return load_config(None, kw)


def test_keys_are_the_chunk_counts_the_collator_produces():
    rng = random.Random(7)
    packs = [tuple(rng.randint(1, 300) for _ in range(rng.randint(1, 6))) for _ in range(40)]
    layout = _layout(packs)
    collate = PackedCollator(layout=layout)
    seen = {registry.batch_sizes(collate([Example([1] * n, [1] * n) for n in p])) for p in packs}
    assert cuda_graph_keys(layout, packs) == seen
    assert 1 < len(seen) <= layout.docs  # varies with the packs, never more than N values (T is fixed)


def test_auto_is_on_for_one_process_the_loop_and_a_static_layout_on_a_gpu():
    layout = _layout()
    c = choose_cuda_graphs(_cfg(), _facts(), "loop", layout)
    n = len(cuda_graph_keys(layout, PACKS))
    assert c.value is True
    assert c.reason.startswith("auto: ") and f"at most {n} graphs per compiled graph" in c.reason
    explicit = choose_cuda_graphs(_cfg(cuda_graphs="on"), _facts(), "loop", layout)
    assert explicit.value is True and explicit.reason.startswith("cuda_graphs: on")


@pytest.mark.parametrize(
    "facts,strategy,static,why",
    [
        ({"device": "cpu"}, "loop", True, "CUDA graphs need a GPU"),
        ({"engine": "ddp", "world": 2}, "loop", True, "2 processes (ddp): CUDA graphs run in one process"),
        ({"engine": "fsdp", "world": 4}, "loop", True, "4 processes (fsdp)"),
        ({}, "modules", True, "compile modules: CUDA graphs record the compiled loop"),
        ({}, "off", True, "compile off"),
        ({}, "loop", False, "the dynamic pack layout changes the step's sizes every batch"),
    ],
)
def test_off_where_it_cannot_run_with_the_reason_and_on_is_refused(facts, strategy, static, why):
    layout = _layout() if static else None
    c = choose_cuda_graphs(_cfg(), _facts(**facts), strategy, layout)
    assert c.value is False and c.reason.startswith("auto: off: ") and why in c.reason, c.reason
    with pytest.raises(ConfigError) as e:
        choose_cuda_graphs(_cfg(cuda_graphs="on"), _facts(**facts), strategy, layout)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("cuda_graphs 'on': ") and why in msg
    assert msg.endswith("use cuda_graphs: auto (or off)")


def test_off_is_off_even_where_it_could_run():
    c = choose_cuda_graphs(_cfg(cuda_graphs="off"), _facts(), "loop", _layout())
    assert c.value is False and c.reason == "cuda_graphs: off"


def test_a_layout_needing_more_graphs_than_the_bound_stays_off():
    # Packs of i 64-token documents: the filler leaves a different chunk count for almost every i.
    packs = tuple((64,) * i for i in range(1, 80))
    layout = StaticLayout.fit([list(p) for p in packs], max_filler=1.0)
    n = len(cuda_graph_keys(layout, packs))
    assert n > choices.MAX_CUDA_GRAPHS
    c = choose_cuda_graphs(_cfg(), _facts(packs=packs), "loop", layout)
    assert c.value is False and f"{n} distinct GDN chunk counts" in c.reason
    with pytest.raises(ConfigError, match=f"cuda_graphs 'on': the static layout's packs have {n} distinct"):
        choose_cuda_graphs(_cfg(cuda_graphs="on"), _facts(packs=packs), "loop", layout)


def test_resolve_logs_a_cuda_graphs_line_after_the_layout():
    cfg = dataclasses.replace(_cfg(), sequence_len=512)
    packs = ((250, 200), (300, 150), (449,), (100, 100, 249))  # nearly full bins: the static layout is cheap
    got = choices.resolve(cfg, _facts(packs=packs))
    names = [line.split(":", 1)[0] for line in got.lines()]
    assert names.index("cuda_graphs") == names.index("pack_layout") + 1
    assert got.compile.value == "loop" and got.pack_layout.value is not None and got.cuda_graphs.value is True
    line = got.lines()[names.index("cuda_graphs")]
    assert line.startswith("cuda_graphs: True (auto: the compiled loop over the static layout in one process")
    cpu = choices.resolve(cfg, Facts(device="cpu", packs=packs))
    assert cpu.cuda_graphs.value is False and "CUDA graphs need a GPU" in cpu.cuda_graphs.reason
