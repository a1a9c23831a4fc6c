"""`hybridtune bench` for preference tuning: the pairs (bench/pairs.py), the dpo modes' specs, the reference's FLOPs,
and (slow tier) hybridtune's dpo beside TRL's DPOTrainer (bench/trl_dpo.py) on the tiny preset."""

from __future__ import annotations

import json
import math
import sys

import pytest

from hybridtune.batch import NUM_PAIRS, NUM_TOKENS
from hybridtune.bench import pairs, trl_dpo, worker
from hybridtune.bench.modes import parse_mode
from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.data.pairs import CHOSEN, REJECTED
from hybridtune.errors import ConfigError
from hybridtune.models.flops import step_flops
from hybridtune.models.presets import preset_config


def test_pairs_have_realistic_lengths_and_fill_packs():
    packs = pairs.make_pairs(8192, 6, vocab_size=5000, seed=1)
    assert len(packs) == 6 and pairs.make_pairs(8192, 6, vocab_size=5000, seed=1) == packs  # seeded
    seen = set()
    for pack in packs:
        assert sum(len(d) for d in pack) <= 8192 and len(pack) % 2 == 0
        rows = pairs.trl_examples(pack)
        assert len(rows) == len(pack) // 2  # every pair whole in its pack, chosen and rejected
        for row in rows:
            assert 200 <= len(row["prompt_ids"]) <= 1000
            assert 100 <= len(row["chosen_ids"]) <= 800 and 100 <= len(row["rejected_ids"]) <= 800
            assert row["chosen_ids"] != row["rejected_ids"]
            assert min(min(v) for v in row.values()) >= 1  # random tokens, never zeros
        for d in pack:  # prompt untrained, reply trained; a pair's two documents share the prompt
            k = d.loss_mask.index(1)
            assert d.loss_mask == [0] * k + [1] * (len(d) - k) and d.side in (CHOSEN, REJECTED)
            seen.add(d.pair)
    assert seen == set(range(len(seen)))  # numbered in order of appearance
    assert sum(sum(len(d) for d in p) for p in packs) / (6 * 8192) > 0.85  # the fullest packs kept
    lengths = pairs.make_pairs(8192, 6, vocab_size=7, seed=1)
    assert pairs.doc_lens(lengths) == pairs.doc_lens(packs)  # lengths do not depend on the vocabulary


def test_pairs_scale_down_to_a_short_sequence_len():
    packs = pairs.make_pairs(256, 3, vocab_size=100, seed=0)
    assert pairs.scale(256) == 256 / 3600 and pairs.scale(4096) == 1.0
    for pack in packs:
        assert 0 < sum(len(d) for d in pack) <= 256
    batches = pairs.pair_batches(packs)
    for b, pack in zip(batches, packs):
        assert b[NUM_PAIRS] == len(pack) // 2 and b[NUM_TOKENS] == sum(b["doc_lens"]) == sum(len(d) for d in pack)


def test_dpo_mode_specs():
    assert parse_mode("ht-loop:objective=dpo").train["objective"] == "dpo"
    assert parse_mode("ht-loop:objective=dpo").objective == "dpo" and parse_mode("ht-loop").objective == "sft"
    trl = parse_mode("trl-dpo")
    assert trl.trl and not trl.patch and trl.objective == "dpo" and trl.gc and not trl.padding_free
    assert parse_mode("trl-dpo-pf").padding_free and not parse_mode("trl-dpo:gradient_checkpointing=false").gc
    for bad, says in [
        ("trl-dpo:objective=simpo", "a trl mode takes"),
        ("trl-dpo:pack_layout=static", "a trl mode takes"),
        ("hf-eager:objective=dpo", "trl-dpo is the dpo baseline"),
        ("ht-eager:objective=grpo", "objective= takes sft|dpo|simpo|orpo"),
    ]:
        with pytest.raises(ConfigError, match=says):
            parse_mode(bad)


def test_reference_flops_are_one_forward():
    """The reference's forward = what gradient checkpointing recomputes of the decoder (one forward of every layer,
    no LoRA: r=0) plus the LM head's forward (half its frozen forward-and-backward count)."""
    cfg = preset_config("qwen3_5-2b")
    lens = [900, 700, 1300, 500]
    recomputed = step_flops(cfg, lens, adapter="lora", gradient_checkpointing=True).breakdown
    want = recomputed["recompute"] + recomputed["lm_head"] / 2
    assert pairs.reference_flops(cfg, lens) == pytest.approx(want, rel=1e-12)


def test_trl_missing_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(ImportError, match=r"pip install trl==1\.16\.0 datasets"):
        trl_dpo._trl()


@pytest.mark.slow  # TRL imported (a few seconds) and its trainer built on the tiny preset
def test_trl_padding_free_refusal_is_said():
    """TRL 1.16 turns padding_free=True off (falls back to padding): trl-dpo-pf is a row saying so, not a rerun of
    trl-dpo. Asked on the tiny preset before a mode loads its model."""
    trl, datasets = trl_dpo._trl()
    mode = parse_mode("trl-dpo-pf")
    cfg = load_config(None, {"base_model": "tiny-qwen3_5", "adapter": "lora", "objective": "dpo"}, warn=False)
    if trl.__version__ != "1.16.0":
        pytest.skip(f"TRL {trl.__version__}: this test pins what 1.16.0 does")
    with pytest.raises(trl_dpo.NotRun, match=r"TRL 1\.16\.0 turns DPOConfig\(padding_free=True\) off"):
        trl_dpo.probe_padding_free(trl, datasets, cfg, mode)


@pytest.mark.slow  # three worker processes (the peak, hybridtune's dpo, TRL's)
def test_bench_dpo_beside_trl_cpu(tmp_path):
    out, table = tmp_path / "bench", tmp_path / "results.jsonl"
    rc = main(
        ["bench", "--modes", "ht-eager:objective=dpo,trl-dpo", "--sequence_len", "256", "--steps", "2",
         "--warmup", "1", "--layouts", "2", "--output_dir", str(out), "--results", str(table)]
    )  # fmt: skip
    assert rc == 0
    doc = json.loads((out / "bench.json").read_text())
    ht, trl = doc["modes"]["ht-eager:objective=dpo"], doc["modes"]["trl-dpo"]
    for r in (ht, trl):
        assert "error" not in r, r.get("error")
        assert all(math.isfinite(x) for x in r["losses"]) and len(r["losses"]) == 3
        # Policy == reference at step 1 (fresh LoRA, B = 0): every pair's z is 0, the loss ln 2.
        assert r["loss_step1"] == pytest.approx(math.log(2), abs=1e-6)
        assert r["reference_flops_per_step"] > 0 and 0 < r["mfu"] < r["hfu"] < 1
    assert ht["step_tokens"] == trl["step_tokens"]  # the same pairs each step, counted without TRL's padding
    assert sum(trl["padded_tokens_per_pack"]) >= sum(doc["pairs"]["tokens_per_pack"])
    assert ht["losses"] == pytest.approx(trl["losses"], rel=1e-4)  # same weights, LoRA draws, pairs, beta
    assert ht["hardware_flops_per_step"] == pytest.approx(trl["hardware_flops_per_step"], rel=1e-12)
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    assert [r["mode"] for r in rows] == ["ht-eager:objective=dpo", "trl-dpo"]
    assert rows[0]["status"] == rows[1]["status"] == "ok"
    assert rows[0]["loss_last10"] == pytest.approx(rows[1]["loss_last10"], rel=1e-4)
    assert "vs trl-dpo" in (out / "bench.md").read_text()


def test_a_full_fine_tune_dpo_mode_has_its_reference():
    """The worker builds the objective with the model, as train does: a full fine-tune's dpo has its frozen copy as
    the reference (step 1: policy == reference, the loss ln 2), and the reference's forward is in the FLOPs."""
    spec = {"kind": "mode", "mode": "ht-eager:objective=dpo", "preset": "tiny-qwen3_5", "seq_len": 256, "layouts": 2,
            "seed": 0, "warmup": 1, "steps": 1, "adapter": "full", "lora_r": 4, "lr": 1e-4,
            "lora_targets": ["q_proj"]}  # fmt: skip
    result = worker.run_mode(spec)
    assert len(result["losses"]) == 2 and all(math.isfinite(x) for x in result["losses"])
    assert result["loss_step1"] == pytest.approx(math.log(2), abs=1e-6)
    assert result["reference_flops_per_step"] > 0
