"""`compile_regions: auto | true | false` (choices.choose_compile_regions): under auto the compiled loop in one
process traces each distinct decoder layer once; under torchrun (DDP, FSDP2) auto stays off, said in the choice
line; without the loop nothing is regional, and an explicit true there is a warning, not silence. The value is what
the trainer hands compile_loop (tests/train/test_cuda_graphs_wiring.py) and a resumed run may switch it
(tests/train/test_redteam_s11.py)."""

from __future__ import annotations

import pytest

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.runtime import facts
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
