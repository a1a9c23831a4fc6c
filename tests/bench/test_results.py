"""hybridtune.bench.results (the append-only results table) and benchmarks/tools/render_docs.py (the tables of
README.md and docs/PERFORMANCE.md rendered from it; not part of the wheel, loaded here by its path)."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from hybridtune.bench import results
from hybridtune.errors import ConfigError

ROOT = Path(__file__).parents[2]
TABLE = ROOT / "benchmarks" / "results.jsonl"


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_docs", ROOT / "benchmarks" / "tools" / "render_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render_docs = _load_renderer()


def row(**kw) -> dict:
    base = {
        "date": "2026-12-01",
        "commit": "0" * 40,
        "device": "NVIDIA H200",
        "versions": {"torch": "2.11.0"},
        "command": "hybridtune bench",
        "tool": "bench",
        "shape": "qwen3_5-2b",
        "seq_len": 4096,
        "mode": "hf-eager",
        "gpus": 1,
        "status": "ok",
        "source": "test",
        "tokens_per_s": 1000.0,
    }
    return base | kw


def test_doc_tables_are_what_render_makes_of_the_table():
    """The generated tables of README.md and docs/PERFORMANCE.md cannot drift from benchmarks/results.jsonl."""
    rows = results.read(TABLE)
    assert set(render_docs.FILES) == {"README.md", "docs/PERFORMANCE.md"}
    for rel, names in render_docs.FILES.items():
        text = (ROOT / rel).read_text(encoding="utf-8")
        assert render_docs.update(text, rows, names, rel) == text, (
            f"{rel}'s generated tables differ from benchmarks/results.jsonl: run `python benchmarks/tools/render_docs.py`"
        )
    shown = [n for names in render_docs.FILES.values() for n in names]
    assert sorted(shown) == sorted(render_docs.TABLES)  # every table lives in exactly one file


def test_headline_pairs_are_hf_eager_against_hybridtune_in_one_run():
    """The README's one table compares like with like: each pair is one bench run's hf-eager row and a hybridtune
    mode of the same run, shape, pack length and adapter."""
    by_id = {r["id"]: r for r in results.read(TABLE)}
    for base, ours in render_docs.TABLES["headline-table"]["rows"]:
        b, r = by_id[base], by_id[ours]
        assert b["mode"] == "hf-eager" and r["mode"].startswith("ht-"), (base, ours)
        assert b["run"] == r["run"] and b["shape"] == r["shape"] and b["adapter"] == r["adapter"], (base, ours)
        assert b["status"] == r["status"] == "ok"
    text = render_docs.render(list(by_id.values()), "headline-table")
    assert "| Qwen3.5-2B | 9,291 tok/s | 33,109 tok/s | **3.56x** |" in text


def test_every_row_has_its_provenance_and_ids_run_one_to_n():
    rows = results.read(TABLE)
    assert [r["id"] for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert all(k in r for k in results.REQUIRED), r["id"]
        assert re.fullmatch(r"[0-9a-f]{40}", r["commit"]), r["id"]
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r["date"]), r["id"]
    cited = {i for spec in render_docs.TABLES.values() for i in render_docs.ids(spec)}
    assert cited <= {r["id"] for r in rows}


def test_append_numbers_after_the_last_row_and_refuses_bad_input(tmp_path):
    t = tmp_path / "r.jsonl"
    assert [r["id"] for r in results.append([row(), row(mode="ht-loop")], t)] == [1, 2]
    assert [r["id"] for r in results.append([row(id=99)], t)] == [3]  # an id passed in is not kept
    assert [r["mode"] for r in results.read(t)] == ["hf-eager", "ht-loop", "hf-eager"]
    with pytest.raises(ConfigError, match="lacks commit"):
        results.append([{k: v for k, v in row().items() if k != "commit"}], t)
    t.write_text(t.read_text() + "{not json\n")
    with pytest.raises(ConfigError, match=r"r\.jsonl:4: not a JSON row"):
        results.read(t)


def test_bench_rows_compare_losses_over_the_steps_every_mode_ran():
    doc = {
        "date": "2026-12-01T00:00:00+00:00",
        "git_commit": "a" * 40,
        "device": "NVIDIA H200",
        "command": "hybridtune bench",
        "versions": {"torch": "2.11.0", "flash-linear-attention": "0.6.0", "python": "3.12"},
        "settings": {"preset": "qwen3_5-2b", "seq_len": 4096, "adapter": "lora", "lora_r": 16},
        "modes": {
            "hf-eager": {"tokens_per_s": 100.0, "median_step_s": 0.5, "losses": [float(i) for i in range(12)]},
            "ht-loop:cg=on": {"tokens_per_s": 300.0, "median_step_s": 0.2, "losses": [float(i) for i in range(20)]},
            "hf-compile": {"error": "no first step within 150 s\nmore", "stopped": True},
        },
    }
    a, b, c = results.bench_rows(doc, source="x")
    assert a["loss_last10"] == b["loss_last10"] == sum(range(2, 12)) / 10  # steps 3-12, which both ran
    assert b["step_ms"] == pytest.approx(200) and b["versions"] == {"torch": "2.11.0", "fla": "0.6.0"}
    assert c["status"] == "no first step within 150 s" and c["tokens_per_s"] is None


def test_render_command_writes_checks_and_names_missing_markers(tmp_path, capsys):
    for rel in ("README.md", "docs/PERFORMANCE.md", "benchmarks/results.jsonl"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    perf = tmp_path / "docs" / "PERFORMANCE.md"
    text = perf.read_text(encoding="utf-8")
    stale = text.replace("| 32,682 |", "| 32,000 |")
    assert stale != text
    perf.write_text(stale)
    root = ["--root", str(tmp_path)]
    assert render_docs.main([*root, "--check"]) == 1
    assert "docs/PERFORMANCE.md: generated tables differ" in capsys.readouterr().err
    assert perf.read_text() == stale  # --check writes nothing
    assert render_docs.main(root) == 0
    assert perf.read_text() == text and render_docs.main([*root, "--check"]) == 0
    (tmp_path / "README.md").write_text("no markers here\n")
    capsys.readouterr()
    assert render_docs.main(root) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: README.md: ") and "<!-- headline-table" in err and "\n" not in err


def test_render_names_rows_the_table_lacks():
    with pytest.raises(ConfigError, match=r"table 'perf-table' names rows \[98"):
        render_docs.render([r for r in results.read(TABLE) if r["id"] != 98], "perf-table")


def test_the_wheel_only_appends_rows():
    """Rendering lives in benchmarks/tools: the package keeps no table of which rows the docs show."""
    assert not any(hasattr(results, n) for n in ("render", "README_TABLES", "update_readme", "SHAPE_FAMILIES"))
    with pytest.raises(SystemExit):
        results.main(["render"])


def test_add_bench_appends_a_run(tmp_path):
    doc = {
        "date": "2026-12-01T00:00:00+00:00",
        "git_commit": "b" * 40,
        "device": "CPU",
        "command": "hybridtune bench",
        "settings": {"preset": "tiny-qwen3_5", "seq_len": 256, "adapter": "full", "lora_r": 16},
        "modes": {"ht-eager": {"tokens_per_s": 5.0, "median_step_s": 1.0, "losses": [1.0, 2.0]}},
    }
    (tmp_path / "bench.json").write_text(json.dumps(doc))
    t = tmp_path / "r.jsonl"
    assert results.main(["--table", str(t), "add-bench", str(tmp_path / "bench.json")]) == 0
    (r,) = results.read(t)
    assert r["id"] == 1 and r["adapter"] == "full" and r["loss_last10"] == 1.5 and r["commit"] == "b" * 40
    assert results.main(["--table", str(t), "add-bench", str(tmp_path / "missing.json")]) == 2


def test_add_train_takes_the_run_machines_provenance_and_a_note(tmp_path, capsys):
    """Runs brought back from a lent GPU machine keep that machine's device and versions (the file `provenance`
    printed there), not the machine that appends them; a bad provenance file is one line, exit 2."""
    from test_dist_table import write_run

    write_run(tmp_path, "lora-1cold", {s: 1000.0 * s for s in range(1, 31)})
    prov = {"date": "2026-12-01", "commit": "a" * 40, "device": "NVIDIA H200", "versions": {"torch": "2.11.0"}}
    (tmp_path / "provenance.json").write_text(json.dumps(prov))
    table = tmp_path / "results.jsonl"
    table.write_text(json.dumps({"id": 7, **row()}) + "\n")
    args = ["--table", str(table), "add-train", str(tmp_path), "lora-1cold", "--command", "hybridtune train x"]
    assert results.main(args + ["--provenance", str(tmp_path / "provenance.json"), "--note", "GPU shared"]) == 0
    new = results.read(table)[-1]
    assert new["id"] == 8 and new["mode"] == "train:cold" and new["note"] == "GPU shared"
    assert {k: new[k] for k in prov} == prov
    (tmp_path / "bad.json").write_text(json.dumps({"device": "x"}))
    assert results.main(args + ["--provenance", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json: no date, commit, versions" in err[0]
    assert len(results.read(table)) == 2  # nothing appended by the refused call


def test_train_table_shows_the_status_and_the_windows_of_a_short_run():
    short = row(id=3, tool="train", mode="train:long", seq_len=131072, tokens_per_s=None, status="no window after "
                "step 10", peak_gib=45.1, first_step_s=148.4, loss_step1=12.8, loss_last=[6, 9.7],
                windows=[[2, 2, 31000.0], [3, 3, 28000.0], [4, 4, 29500.0]])  # fmt: skip
    long = row(id=4, tool="train", mode="train:cold", tokens_per_s=33000.0, peak_gib=14.1, first_step_s=117.0,
               loss_step1=12.8, loss_last=[30, 4.9], windows=[[2, 5, 8000.0], [6, 10, 34000.0], [11, 15, 32000.0]])  # fmt: skip
    lines = render_docs._train_table({3: short, 4: long}, [3, 4])
    assert "| no window after step 10 | 28,000-31,000 | 45.10 | 148 s | 12.800 -> 9.700 (step 6) | 3 |" in lines[2]
    assert "| 33,000 | 32,000-34,000 |" in lines[3]  # the window that recorded the CUDA graphs (2-5) left out


def test_shape_labels_shorten_the_preset_families():
    _shape = render_docs._shape

    assert _shape({"shape": "qwen3_5-2b"}) == "2B"
    assert _shape({"shape": "qwen3_5-35b-a3b@layers=8"}) == "35B-A3B@layers=8"
    assert _shape({"shape": "qwen3_next-80b-a3b@layers=24"}) == "Next-80B-A3B@layers=24"
    assert _shape({"shape": "tiny-qwen3_next"}) == "tiny-qwen3_next"  # not a family prefix: as it is
    assert _shape({"shape": "qwen3_next-80b-a3b@layers=24"}, full=True) == "Qwen3-Next-80B-A3B@layers=24"
    assert _shape({"shape": "qwen3_5-35b-a3b"}, full=True) == "Qwen3.5-35B-A3B"
