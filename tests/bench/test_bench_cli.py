"""`hybridtune bench` on CPU (tiny preset): every mode runs in its own process and reports what it must."""

from __future__ import annotations

import json

import pytest

from hybridtune.bench.data import make_batches, pack_layouts
from hybridtune.bench.modes import cudagraph_warmup, current_label, parse_mode, split_modes
from hybridtune.bench.report import markdown
from hybridtune.cli import main
from hybridtune.errors import ConfigError


def test_packs_are_full_and_spread():
    layouts = pack_layouts(4096, 20, seed=3)
    assert all(sum(lens) == 4096 for lens in layouts)
    flat = [n for lens in layouts for n in lens]
    assert min(flat) >= 16 and max(flat) > 1500 and len(set(flat)) > 50  # a spread, not one fixed length
    assert pack_layouts(4096, 20, seed=3) == layouts  # deterministic: every mode sees the same packs
    b = make_batches(layouts[:1], 1000, seed=0)[0]
    assert b["input_ids"].shape == (1, 4096) and b["doc_lens"] == layouts[0]
    static = make_batches(layouts[:4], 1000, seed=0, static=True)
    assert len({s["input_ids"].shape for s in static}) == len({s["cu_seq_lens_q"].shape for s in static}) == 1
    assert static[0]["input_ids"].shape[1] > 4096 and all(s["num_tokens"] == 4096 for s in static)
    assert static[0]["input_ids"][0, :4096].tolist() == b["input_ids"][0].tolist()
    assert 0.6 < b["num_loss_tokens"] / 4096 < 0.8  # prompts (first quarter of each document) untrained


def test_mode_specs_are_train_keys():
    """A hybridtune mode's options are `hybridtune train`'s keys and values, checked by train's config."""
    m = parse_mode("ht-loop:cuda_graphs=true,compile_regions=true,keep_mixer_cores=true,gradient_checkpointing=false")
    assert m.label == "ht-loop:compile_regions=true,cuda_graphs=on,gradient_checkpointing=false,keep_mixer_cores=true"
    assert m.train == {
        "compile": "loop",
        "pack_layout": "static",
        "loss": "fused",
        "cuda_graphs": "on",
        "compile_regions": True,
        "keep_mixer_cores": True,
        "gradient_checkpointing": False,
    }
    assert parse_mode("ht-loop").train["keep_mixer_cores"] is False and not parse_mode("ht-loop").cudagraphs
    assert parse_mode("ht-loop:pack_layout=dynamic").train["pack_layout"] == "dynamic"
    assert parse_mode("ht-loop:conv=op,cuda_graphs=on").forms == {"conv": "op"} and parse_mode("ht-loop").forms == {}
    assert split_modes("ht-loop:cg=on, ht-loop:cg=on,conv=op,hf-eager,") == [
        "ht-loop:cg=on",
        "ht-loop:cg=on,conv=op",
        "hf-eager",
    ]
    with pytest.raises(ConfigError, match="unknown bench mode 'gc=off'"):  # an option with no mode before it
        [parse_mode(s) for s in split_modes("gc=off,ht-loop")]
    with pytest.raises(ConfigError, match="conv= chooses"):
        parse_mode("hf-eager:conv=op")
    with pytest.raises(ConfigError, match="keep_mixer_cores is a hybridtune mode's"):
        parse_mode("hf-eager:keep_mixer_cores=true")
    with pytest.raises(ConfigError, match="Did you mean 'ht-loop'"):
        parse_mode("ht-lop")
    with pytest.raises(ConfigError, match="key 'cuda_graphs'"):  # train's own error for the value
        parse_mode("ht-loop:cuda_graphs=sometimes")
    with pytest.raises(ConfigError, match="is not one of: cuda_graphs="):
        parse_mode("ht-loop:compile=off")
    with pytest.raises(ConfigError, match=r"gc= takes on\|off"):  # an earlier spelling, checked as before
        parse_mode("ht-loop:gc=maybe")


@pytest.mark.parametrize(
    "old,new",
    [
        ("ht-loop:gc=off", "ht-loop:gradient_checkpointing=false"),
        ("ht-loop:cg=on,regions=on,sac=on", "ht-loop:compile_regions=true,cuda_graphs=on,keep_mixer_cores=true"),
        ("ht-loop:cg=on,conv=op", "ht-loop:conv=op,cuda_graphs=on"),
        ("hf-compile:cg=on", "hf-compile:cuda_graphs=on"),
        ("ht-loop:layout=dynamic,loss=plain", "ht-loop:loss=plain,pack_layout=dynamic"),
        ("train:cold", "train:cold"),  # a row's label that is no mode spec stays as it is
    ],
)
def test_earlier_labels_read_as_train_keys(old, new):
    """benchmarks/results.jsonl's rows and single_gpu.sh's lanes spell options the earlier way: they still parse,
    to the same mode, written with train's names."""
    assert current_label(old) == new
    if not old.startswith("train"):
        assert parse_mode(old) == parse_mode(new)


def test_one_warmup_for_every_mode_stretched_for_cuda_graphs():
    """CUDA graphs record on the second call of each layout, so a run with any cg=on mode warms up on every
    layout twice, and every mode of the run with it (their losses must cover the same steps)."""
    eager, graphed = parse_mode("hf-eager"), parse_mode("ht-loop:cg=on")
    assert cudagraph_warmup(3, 4, [eager, parse_mode("ht-loop")]) == 3
    assert cudagraph_warmup(3, 4, [graphed, eager]) == 8 and cudagraph_warmup(10, 4, [eager, graphed]) == 10
    doc = {
        "settings": {"preset": "p", "seq_len": 8, "adapter": "full", "dtype": "bf16", "steps": 2, "warmup": 8}
        | {"warmup_asked": 3},
        "device": "d",
        "git_commit": "abc",
        "modes": {},
    }
    assert "stretched from 3 to 8 steps for every mode" in markdown(doc)


@pytest.mark.slow  # three modes, each in its own process, one of them compiled
def test_bench_cpu_smoke(tmp_path, capsys):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--modes",
            "hf-eager,ht-eager,ht-loop",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--layouts",
            "2",
            "--compile_backend",
            "aot_eager",
            "--output_dir",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["settings"]["preset"] == "tiny-qwen3_5" and doc["peak"]["flops_per_s"] > 0
    assert set(doc["modes"]) == {"hf-eager", "ht-eager", "ht-loop"}
    for label, r in doc["modes"].items():
        assert "error" not in r, (label, r.get("error"))
        assert r["tokens_per_s"] > 0 and len(r["step_times_s"]) == 3 and r["first_step_s"] > 0
        assert r["model_flops_per_step"] > 0 and r["hardware_flops_per_step"] > r["model_flops_per_step"]  # GC on
        assert 0 < r["mfu"] < r["hfu"] < 1
    base = doc["modes"]["hf-eager"]
    for label in ("ht-eager", "ht-loop"):
        r = doc["modes"][label]
        # Same weights, data and seeds; fused vs plain loss: equal to fp32 rounding.
        assert r["loss_step1"] == pytest.approx(base["loss_step1"], rel=1e-5)
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-4)
    assert doc["modes"]["ht-loop"]["graph_breaks"] == 0 and doc["modes"]["ht-loop"]["graphs"] >= 1
    assert doc["modes"]["ht-loop"]["recompiles_after_warmup"] == 0
    # Where the first step's compile went, by torch's timed phases (dynamo's whole compile holds the others).
    phases = doc["modes"]["ht-loop"]["compile_phases_s"]
    assert phases.get("_compile.compile_inner", 0) > 0
    assert phases["_compile.compile_inner"] >= max(
        (v for k, v in phases.items() if k != "_compile.compile_inner"), default=0
    )
    assert doc["modes"]["ht-eager"]["compile_phases_s"] == {}  # nothing compiled in an eager mode
    table = (out / "bench.md").read_text()
    assert "| ht-loop | on |" in table and "1.00x" in table
    assert (out / "bench.png").stat().st_size > 1000
    assert "| hf-eager |" in capsys.readouterr().out


def test_mode_that_does_not_start_is_stopped(tmp_path):
    out = tmp_path / "bench"
    rc = main(
        [
            "bench",
            "--modes",
            "ht-eager",
            "--steps",
            "1",
            "--warmup",
            "1",
            "--startup_timeout",
            "0.5",
            "--output_dir",
            str(out),
            "--results",
            str(tmp_path / "results.jsonl"),
        ]
    )
    assert rc == 0
    r = json.loads((out / "bench.json").read_text())["modes"]["ht-eager"]
    assert r["error"] == "no first step within 0 s" and r["stopped"]  # 0.5 s, printed with no decimals
    assert "no first step within" in (out / "bench.md").read_text()
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert row["id"] == 1 and row["mode"] == "ht-eager" and row["status"] == "no first step within 0 s"
    assert row["tokens_per_s"] is None and row["shape"] == "tiny-qwen3_5" and row["command"].startswith("hybridtune")


@pytest.mark.parametrize("flag", ["--base_model", "--preset"])  # --preset: the spelling of earlier releases
def test_bad_preset_is_one_line(capsys, flag):
    assert main(["bench", flag, "qwen3_5-2c"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --base_model 'qwen3_5-2c' is not a preset") and "qwen3_5-2b" in err
    assert "\n" not in err


def test_a_damaged_results_table_is_said_before_the_run(tmp_path, capsys):
    table = tmp_path / "results.jsonl"
    table.write_text("{broken\n")
    assert main(["bench", "--modes", "ht-eager", "--results", str(table), "--output_dir", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "results.jsonl:1: not a JSON row" in err and "\n" not in err
    assert not (tmp_path / "b" / "bench.json").exists()
