"""`compile_regions: auto | true | false` (choices.choose_compile_regions): under auto the compiled loop in one
process traces each distinct decoder layer once; under torchrun (DDP, FSDP2) auto stays off, said in the choice
line; without the loop nothing is regional, and an explicit true there is a warning, not silence. The value is what
the trainer hands compile_loop (tests/runtime/test_cuda_graphs_wiring.py) and a resumed run may switch it
(tests/run/test_outdir.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hybridtune.config import load_config, parse_overrides, to_dict
from hybridtune.errors import ConfigError
from hybridtune.runtime import choices, distributed, facts, measure
from hybridtune.runtime.choices import Facts, choose_compile_regions


def _facts(**kw) -> Facts:
    return Facts(**{"device": "cuda", "bf16_supported": True, **kw})


def test_auto_is_on_for_the_loop_in_one_process():
    for device in ("cuda", "cpu"):  # facts only: no GPU needed
        c = choose_compile_regions(load_config(None, {}), _facts(device=device), "loop")
        assert c.value is True and c.reason.startswith("auto: each distinct decoder layer traced once")
        assert not c.warnings


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_auto_is_off_under_torchrun_and_says_why(engine):
    c = choose_compile_regions(load_config(None, {}), _facts(engine=engine, world=2), "loop")
    assert c.value is False and c.reason == f"auto: off under {engine} (2 processes): not yet checked there"
    on = choose_compile_regions(load_config(None, {"compile_regions": True}), _facts(engine=engine, world=2), "loop")
    assert on.value is True and on.reason == "compile_regions: true"  # an explicit true is the user's to take
    assert on.warnings == (f"compile_regions: true under {engine}: the regional loop is not yet checked there",)


@pytest.mark.parametrize("strategy", ["off", "modules"])
def test_without_the_loop_nothing_is_regional(strategy):
    auto = choose_compile_regions(load_config(None, {}), _facts(), strategy)
    assert auto.value is False and auto.reason == f"auto: no loop (compile {strategy})" and not auto.warnings
    on = choose_compile_regions(load_config(None, {"compile_regions": True}), _facts(), strategy)
    assert on.value is False
    assert on.warnings == (f"compile_regions: no effect under compile strategy '{strategy}' (regions are the loop's)",)


def test_false_is_off_and_the_choice_is_logged_in_order():
    c = choose_compile_regions(load_config(None, {"compile_regions": False}), _facts(), "loop")
    assert c.value is False and c.reason == "compile_regions: false"
    assert facts.ORDER.index("compile_regions") == facts.ORDER.index("compile") + 1


@pytest.mark.parametrize("text,want", [("true", True), ("false", False), ("auto", "auto")])
def test_the_cli_and_yaml_spellings(tmp_path, text, want):
    f = tmp_path / "c.yaml"
    f.write_text(f"compile_regions: {text}\n")
    assert load_config(str(f), {}).compile_regions == want


def test_a_wrong_value_is_one_line_naming_the_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("compile_regions: sometimes\n")
    with pytest.raises(ConfigError, match="compile_regions"):
        load_config(str(f), {})


@pytest.mark.parametrize(
    "raw,want", [("auto", "auto"), ("true", True), ("yes", True), ("on", True), ("false", False), ("off", False)]
)
def test_cli_spellings(raw, want):
    assert load_config(None, parse_overrides(["--compile_regions", raw])).compile_regions == want


def test_bare_flag_is_true():
    assert load_config(None, parse_overrides(["--compile_regions"])).compile_regions is True


@pytest.mark.parametrize("raw", ["1", "sometimes", "AUTO"])
def test_a_bad_cli_value_is_one_line_naming_the_key(raw):
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


def test_choice_lines_name_compile_regions_after_compile():
    c = choices.resolve(load_config(None, {"compile": "loop"}), Facts(device="cpu"))
    names = [line.split(":")[0] for line in c.lines()]
    assert names.index("compile_regions") == names.index("compile") + 1
    assert c.compile_regions.value is True
    assert c.lines()[names.index("compile_regions")].startswith("compile_regions: True (auto: each distinct")


def test_torchrun_with_one_process_counts_as_one_process(monkeypatch):
    """torchrun --nproc_per_node 1 (WORLD_SIZE=1) is one process: no engine, so regions are on."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, {"compile": "loop"})
    facts = measure.measure(cfg, torch.device("cpu"), distributed.from_env())
    assert facts.engine == "none"
    assert choose_compile_regions(cfg, facts, "loop").value is True
