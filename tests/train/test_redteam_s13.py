"""Red-team (s13) tests for `compile_regions: auto` (eede9b5): the run file of an earlier version, the CLI and YAML
spellings, the choice lines, the single-process torchrun decision, eval generations and the out-of-memory retry
under the real regional loop (aot_eager on the CPU)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from test_redteam_s11 import _held
from test_resume import make_cfg
from test_train_regions import run

from hybridtune.config import load_config, parse_overrides, to_dict
from hybridtune.errors import ConfigError
from hybridtune.run import outdir
from hybridtune.runtime import choices
from hybridtune.runtime.choices import Facts, choose_compile_regions
from hybridtune.train.trainer import Trainer

# --- the run file of the version before auto --------------------------------------------------------------------


def test_same_command_again_over_a_run_recorded_before_auto(tmp_path, small_data):
    """Was a defect (fixed: compile_regions and cuda_graphs are outdir.RERUN_FREE_KEYS). The version before
    eede9b5 recorded `compile_regions: false` (its default) in every run file. The same command run again over that
    run (no --compile_regions given either time) read "auto" and was refused as another config ("compile_regions:
    False -> 'auto'"), though regions compute the same thing."""
    out = tmp_path / "run"
    _held(out, make_cfg(out, small_data, compile="loop", compile_regions=False))  # the old default, recorded
    cfg = make_cfg(out, small_data, compile="loop")  # the same command, under the new default
    assert outdir.check_output_dir(cfg) is True


def test_same_command_again_after_switching_regions_explicitly(tmp_path, small_data):
    """Was a defect (same root, same fix). A finished run with regions on, run again with `--compile_regions false`
    (to compare the first step, say): nothing it computes changes, yet it was refused unless --overwrite."""
    out = tmp_path / "run"
    _held(out, make_cfg(out, small_data, compile="loop", compile_regions=True))
    assert outdir.check_output_dir(make_cfg(out, small_data, compile="loop", compile_regions=False)) is True


@pytest.mark.parametrize("before", [False, True])
def test_resume_of_a_run_recorded_before_auto(tmp_path, small_data, before):
    """Pins: a resume over an older run file with false/true under the new default auto is accepted."""
    out = tmp_path / "run"
    _held(out, make_cfg(out, small_data, compile="loop", compile_regions=before))
    outdir.check_output_dir(make_cfg(out, small_data, compile="loop", resume_from_checkpoint="latest"))


def test_a_run_file_that_predates_the_key_counts_at_the_new_default(tmp_path, small_data):
    """Pins: a run file without the key (older still) compares at today's default, so no change is reported."""
    out = tmp_path / "run"
    cfg = make_cfg(out, small_data, compile="loop")
    _held(out, cfg)
    record = json.loads((out / outdir.RUN_FILE).read_text())
    del record["config"]["compile_regions"]
    (out / outdir.RUN_FILE).write_text(json.dumps(record))
    assert outdir.check_output_dir(cfg) is True


# --- spellings and errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw,want", [("auto", "auto"), ("true", True), ("yes", True), ("on", True), ("false", False), ("off", False)]
)
def test_cli_spellings(raw, want):
    assert load_config(None, parse_overrides(["--compile_regions", raw])).compile_regions == want


def test_bare_flag_is_true():
    assert load_config(None, parse_overrides(["--compile_regions"])).compile_regions is True


@pytest.mark.parametrize("raw", ["1", "sometimes", "AUTO"])
def test_a_bad_value_is_one_line_naming_the_key(raw):
    with pytest.raises(ConfigError) as e:
        load_config(None, parse_overrides(["--compile_regions", raw]))
    assert "compile_regions" in str(e.value) and "\n" not in str(e.value)


def test_cli_bad_value_exits_2_without_traceback(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "hybridtune", "train", "--compile_regions", "sometimes", "--output_dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and "compile_regions" in p.stderr


def test_run_file_records_auto_as_given():
    assert to_dict(load_config(None, {}))["compile_regions"] == "auto"


# --- the choice -------------------------------------------------------------------------------------------------


def test_choice_lines_name_compile_regions_after_compile():
    c = choices.resolve(load_config(None, {"compile": "loop"}), Facts(device="cpu"))
    names = [line.split(":")[0] for line in c.lines()]
    assert names.index("compile_regions") == names.index("compile") + 1
    assert c.compile_regions.value is True
    assert c.lines()[names.index("compile_regions")].startswith("compile_regions: True (auto: each distinct")


def test_torchrun_with_one_process_counts_as_one_process(monkeypatch):
    """Pins: torchrun --nproc_per_node 1 (WORLD_SIZE=1) is one process: no engine, so regions are on."""
    from hybridtune.runtime import distributed

    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, {"compile": "loop"})
    facts = choices.measure(cfg, torch.device("cpu"), distributed.from_env())
    assert facts.engine == "none"
    assert choose_compile_regions(cfg, facts, "loop").value is True


# --- the real trainer with the real regional loop ---------------------------------------------------------------


def test_eval_generations_after_regional_training(tmp_path, small_data, aot_eager):
    """Pins: greedy generations (the upstream forward with a cache, through the regions' installed layer forwards)
    after training under the regional loop are those of the uncompiled run."""
    kw = dict(eval_samples=2, eval_max_new_tokens=4)
    _, plain = run(tmp_path / "off", small_data, max_steps=2, compile="off", **kw)
    t, regional = run(tmp_path / "reg", small_data, max_steps=2, compile="loop", **kw)
    assert t.choices.compile_regions.value is True and aot_eager[-1].regions.regional
    assert regional.losses == pytest.approx(plain.losses, rel=1e-5)
    a, b = regional.evals[-1], plain.evals[-1]
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    assert len(a["samples"]) == 2
    assert [s["generated"] for s in a["samples"]] == [s["generated"] for s in b["samples"]]


def test_oom_retry_keeps_the_regional_loop(tmp_path, small_data, aot_eager, monkeypatch):
    """Pins: the first step's out-of-memory retry (gradient_checkpointing: auto) switches checkpointing on after
    the regional loop was compiled; the retried run stays regional and trains as the uncompiled checkpointed run."""
    real = Trainer.train_step
    calls = []

    def flaky(self):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(self)

    _, plain = run(tmp_path / "off", small_data, max_steps=2, compile="off", gradient_checkpointing=True)
    monkeypatch.setattr(Trainer, "train_step", flaky)
    t, regional = run(tmp_path / "reg", small_data, max_steps=2, compile="loop", gradient_checkpointing="auto")
    assert t.choices.checkpointing.value is False and len(calls) >= 2  # the retry ran
    regs = aot_eager[-1].regions
    assert regs is not None and regs.regional
    assert any(getattr(m, "gradient_checkpointing", False) for m in t.model.modules())  # switched on by the retry
    assert regional.losses == pytest.approx(plain.losses, rel=1e-5)
