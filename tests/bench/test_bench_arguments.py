"""The bench scripts' arguments (the red team's findings, issue 34): `hybridtune bench` (--vision too), `python -m
hybridtune.bench.generation` and `python -m hybridtune.bench.grpo_pair` gave tracebacks for zero, negative and
non-numeric counts, lengths and ranges, a file as output folder, a folder as results table, an unknown model, or
took nonsense (--learning_rate nan, --lora_r 0, --steps 10000000000, --seed -1) and ran every mode into an error;
now each is one line on stderr naming the flag, exit 2, before anything runs. And grpo_pair exited 0 when a side
failed: now 1, with one line naming the side and its log.

The bad arguments run in this process: each is refused before a model, a worker or a subprocess starts (the base
arguments keep anything that is not refused short: one tiny mode, one step).
"""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from hybridtune.bench import grpo_pair, vl_data
from hybridtune.bench.command import parse_args
from hybridtune.cli import main as cli_main
from hybridtune.config import MAX_SEED

BENCH_BASE = ["--modes", "ht-eager", "--steps", "1", "--warmup", "1", "--layouts", "1", "--mode_timeout", "30"]
GEN_BASE = ["--base_model", "tiny-qwen3_5", "--rows", "1", "--new_tokens", "2", "--prompt_tokens", "2-3"]
GRPO_BASE = ["--base_model", "tiny-qwen3_5", "--steps", "1", "--prompts", "1", "--num_generations", "2"]
GRPO_BASE += ["--max_completion_length", "2", "--prompt_tokens", "2-3", "--only", "ht"]

# (script, the bad arguments, what the one line must hold: the flag, and the value where it is the flag's own)
BAD = [
    ("bench", ["--steps", "0"], ["--steps", "'0'", "1 to 10000"]),
    ("bench", ["--steps", "-1"], ["--steps", "'-1'"]),
    ("bench", ["--steps", "x"], ["--steps", "'x'"]),
    ("bench", ["--steps", "10000000000"], ["--steps", "'10000000000'"]),
    ("bench", ["--warmup", "-3"], ["--warmup", "'-3'"]),
    ("bench", ["--layouts", "0"], ["--layouts", "'0'", "1 to 256"]),
    ("bench", ["--layouts", "many"], ["--layouts", "'many'"]),
    ("bench", ["--sequence_len", "0"], ["--sequence_len", "'0'", "16 to"]),
    ("bench", ["--sequence_len", "-5"], ["--sequence_len", "'-5'"]),
    ("bench", ["--seq-len", "3"], ["--seq-len", "'3'"]),  # an old spelling keeps the check
    ("bench", ["--lora_r", "0"], ["--lora_r", "'0'"]),
    ("bench", ["--lora_r", "-2"], ["--lora_r", "'-2'"]),
    ("bench", ["--learning_rate", "-1"], ["--learning_rate", "'-1'", "above 0"]),
    ("bench", ["--learning_rate", "nan"], ["--learning_rate", "'nan'"]),
    ("bench", ["--learning_rate", "inf"], ["--learning_rate", "'inf'"]),
    ("bench", ["--seed", "-1"], ["--seed", "'-1'"]),
    ("bench", ["--startup_timeout", "-1"], ["--startup_timeout", "'-1'"]),
    ("bench", ["--mode_timeout", "0"], ["--mode_timeout", "'0'"]),
    ("bench", ["--mode_timeout", "nan"], ["--mode_timeout", "'nan'"]),
    ("bench", ["--output_dir", "{file}"], ["--output_dir", "{file}", "give a folder"]),
    ("bench", ["--results", "{dir}"], ["--results", "{dir}", "is a folder"]),
    ("bench", ["--results", "{file}/r.jsonl"], ["--results", "{file}/r.jsonl", "not a folder"]),
    ("bench", ["--save_kernel_configs", "{dir}"], ["--save_kernel_configs", "{dir}"]),
    ("bench", ["--output_dir", ""], ["--output_dir", "an empty path; give a folder"]),
    ("bench", ["--results", ""], ["--results", "an empty path; give a file's path"]),
    ("bench", ["--lora_target_modules", ","], ["--lora_target_modules", "','"]),
    ("bench", ["--compile_backend", "inductr"], ["--compile_backend", "'inductr'", "inductor"]),
    ("bench", ["--base_model", "tiny-qwen3_5@layers=0"], ["tiny-qwen3_5@layers=0", "1 to 4"]),
    ("bench", ["--bogus", "3"], ["--bogus"]),
    ("bench", ["--vision", "--sequence_len", "200000"], ["--sequence_len 200000", "--vision", "131072"]),
    ("generation", ["--rows", "0"], ["--rows", "'0'", "1 to 4096"]),
    ("generation", ["--rows", "-1"], ["--rows", "'-1'"]),
    ("generation", ["--rows", "x"], ["--rows", "'x'"]),
    ("generation", ["--new_tokens", "0"], ["--new_tokens", "'0'"]),
    ("generation", ["--new_tokens", "10000000"], ["--new_tokens", "'10000000'"]),
    ("generation", ["--prompt_tokens", "x"], ["--prompt_tokens", "'x'", "LOW-HIGH"]),
    ("generation", ["--prompt_tokens", "10-5"], ["--prompt_tokens", "'10-5'"]),
    ("generation", ["--prompt_tokens", "0-5"], ["--prompt_tokens", "'0-5'"]),
    ("generation", ["--prompt_tokens", "5"], ["--prompt_tokens", "'5'"]),
    ("generation", ["--base_model", "no-such-preset"], ["base_model", "'no-such-preset'"]),
    ("generation", ["--base_model", "{dir}"], ["base_model", "{dir}", "config.json"]),
    ("generation", ["--output_dir", "{file}"], ["--output_dir", "{file}"]),
    ("generation", ["--results", "{dir}"], ["--results", "{dir}"]),
    ("grpo_pair", ["--steps", "0"], ["--steps", "'0'", "1 to 10000"]),
    ("grpo_pair", ["--steps", "-2"], ["--steps", "'-2'"]),
    ("grpo_pair", ["--prompts", "0"], ["--prompts", "'0'"]),
    ("grpo_pair", ["--num_generations", "1"], ["--num_generations", "'1'", "2 to"]),
    ("grpo_pair", ["--num_generations", "0"], ["--num_generations", "'0'"]),
    ("grpo_pair", ["--max_completion_length", "0"], ["--max_completion_length", "'0'"]),
    ("grpo_pair", ["--prompt_tokens", "9-2"], ["--prompt_tokens", "'9-2'"]),
    ("grpo_pair", ["--prompt_tokens", "q"], ["--prompt_tokens", "'q'"]),
    ("grpo_pair", ["--base_model", "no-such-preset"], ["base_model", "'no-such-preset'"]),
    ("grpo_pair", ["--base_model", "tiny-qwen3_5@layers=9"], ["tiny-qwen3_5@layers=9"]),
    ("grpo_pair", ["--output_dir", "{file}"], ["--output_dir", "{file}"]),
    ("grpo_pair", ["--results", "{dir}"], ["--results", "{dir}"]),
]


def _run(script: str, argv: list[str], monkeypatch) -> int:
    """The script as its users run it: `hybridtune bench` through the CLI, the others as `python -m`."""
    try:
        if script == "bench":
            return cli_main(["bench", *argv])
        monkeypatch.setattr(sys, "argv", [script, *argv])
        runpy.run_module(f"hybridtune.bench.{script}", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return e.code
    raise AssertionError(f"{script} {argv} ran to its end")


@pytest.mark.filterwarnings("ignore:'hybridtune.bench.:RuntimeWarning")  # (runpy: the module is imported here too)
@pytest.mark.parametrize(("script", "bad", "said"), BAD, ids=[f"{s}:{' '.join(b)}" for s, b, _ in BAD])
def test_a_bad_argument_is_one_line_naming_the_flag_exit_2(script, bad, said, tmp_path, monkeypatch, capsys):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "a-dir").mkdir()
    fill = {"{file}": str(tmp_path / "a-file"), "{dir}": str(tmp_path / "a-dir")}

    def filled(text: str) -> str:
        for k, v in fill.items():
            text = text.replace(k, v)
        return text

    base = {"bench": BENCH_BASE, "generation": GEN_BASE, "grpo_pair": GRPO_BASE}[script]
    out = ["--output_dir", str(tmp_path / "out")]
    rc = _run(script, [*base, *out, *map(filled, bad)], monkeypatch)
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith("error: "), err
    for part in map(filled, said):
        assert part in err, (part, err)
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_the_ranges_edges_parse():
    a = parse_args(["--sequence_len", "16", "--steps", "10000", "--learning_rate", "1e10", "--seed", str(MAX_SEED)])
    assert (a.sequence_len, a.steps, a.learning_rate, a.seed) == (16, 10000, 1e10, MAX_SEED)
    a = parse_args(["--layouts", "256", "--lora_r", "1", "--startup_timeout", "0.5", "--mode_timeout", "604800"])
    assert (a.layouts, a.lora_r, a.startup_timeout, a.mode_timeout) == (256, 1, 0.5, 604800.0)
    assert parse_args([]).output_dir == "outputs/bench"  # a default is a folder name, as before


def test_vl_data_refuses_a_pack_no_document_fits_rather_than_drawing_forever(tmp_path):
    with pytest.raises(ValueError, match="sequence_len 5"):
        vl_data.make_documents(tmp_path, None, 100, 5, 1, 0)


# grpo_pair's two sides replaced by tiny scripts: what `hybridtune train` and the TRL child leave behind.
FAIL = "import sys; print('step 1'); sys.stderr.write('RuntimeError: boom\\n'); sys.exit(1)"
HT_OK = "import json, pathlib, sys; p = pathlib.Path(sys.argv[1]); p.mkdir(parents=True); p.joinpath('metrics.jsonl')"
HT_OK += ".write_text(''.join(json.dumps({'type': 'train', 'step': s, 'step_s': 0.5}) + '\\n' for s in (1, 2, 3)))"
TRL_OK = "import json, pathlib, sys; pathlib.Path(sys.argv[1], 'trl.json').write_text(json.dumps({'steps': "
TRL_OK += "[{'step': s, 'step_s': 1.0} for s in (1, 2, 3)]}))"


def _sides(monkeypatch, ht: str, trl: str) -> None:
    monkeypatch.setattr(grpo_pair, "ht_command", lambda a, work, data, out: [sys.executable, "-c", ht, str(out)])
    monkeypatch.setattr(grpo_pair, "trl_command", lambda a, work: [sys.executable, "-c", trl, str(work)])


PAIR = ["--base_model", "tiny-qwen3_5", "--steps", "3", "--prompts", "1", "--prompt_tokens", "2-3"]


@pytest.mark.parametrize(
    ("ht", "trl", "failed", "log"),
    [(FAIL, TRL_OK, "hybridtune", "ht.log"), (HT_OK, FAIL, "trl", "trl.log")],
    ids=["hybridtune-fails", "trl-fails"],
)
def test_grpo_pair_exits_non_zero_naming_the_side_that_failed_and_its_log(
    ht, trl, failed, log, tmp_path, monkeypatch, capsys
):
    _sides(monkeypatch, ht, trl)
    out = tmp_path / "out"
    rc = grpo_pair.main([*PAIR, "--output_dir", str(out), "--results", str(tmp_path / "results.jsonl")])
    err = capsys.readouterr().err.strip()
    assert rc == 1
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith(f"error: grpo_pair: the {failed} side failed (exit 1: RuntimeError: boom)"), err
    assert err.endswith(f"its log: {out / log}") and "boom" in (out / log).read_text()
    other = {"hybridtune": "trl", "trl": "hybridtune"}[failed]
    assert f"the {other} side" not in err
    tools = json.loads((out / "grpo_pair.json").read_text())["tools"]
    assert tools[failed]["error"] == "RuntimeError: boom" and tools[other]["median_step_s"]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert {r["mode"]: r["status"] for r in rows} == {f"grpo {failed}": "RuntimeError: boom", f"grpo {other}": "ok"}


def test_grpo_pair_exits_0_when_both_sides_ran(tmp_path, monkeypatch, capsys):
    _sides(monkeypatch, HT_OK, TRL_OK)
    assert grpo_pair.main([*PAIR, "--output_dir", str(tmp_path)]) == 0
    assert "error" not in capsys.readouterr().err
    doc = json.loads((tmp_path / "grpo_pair.json").read_text())
    assert doc["speedup"] == 2.0  # (TRL's 1.0 s a step over hybridtune's 0.5 s)
