"""`optim`: each optimizer trains the tiny preset (a bf16 full fine-tune, where the optimizer decides how weights are
held) and resumes from a DCP checkpoint to the very next-step loss of an uninterrupted run; names and errors."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.runtime import optim
from train_runs import make_cfg, run


def test_a_bad_optim_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError) as e:
        load_config(None, {"optim": "sgd"})
    msg = str(e.value)
    assert "\n" not in msg and "optim" in msg and "adamw_8bit" in msg and "adamw_bf16_sr" in msg, msg


@pytest.mark.parametrize(
    ("given", "ours"),
    [("adamw_torch", "adamw"), ("adamw_torch_fused", "adamw"), ("adamw_bnb_8bit", "adamw_8bit"), ("adamw", "adamw")],
)
def test_transformers_names_read_as_ours(given, ours):
    assert optim.optim_name(load_config(None, {"optim": given})) == ours


def test_without_torchao_one_line_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # import fails as if torchao were not installed
    cfg = load_config(None, {"optim": "adamw_8bit", "adapter": "full"})
    with pytest.raises(ConfigError, match=r"pip install 'hybridtune\[optim\]'") as e:
        optim.build_optimizer([torch.nn.Parameter(torch.zeros(2))], cfg, torch.device("cpu"))
    assert "\n" not in str(e.value)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "adamw_bf16_sr"])
def test_each_optim_trains_and_resumes_to_the_next_step_loss(tmp_path, small_data, name):
    """4 steps uninterrupted against 2 + a resume from checkpoint-2: steps 3 and 4 give the same loss (the masters,
    the 8-bit states with their scales, the bf16 states and the RNG of stochastic rounding all restored)."""
    kw = dict(adapter="full", bf16=True, optim=name, max_steps=4, lora_dropout=0.0)
    torch.use_deterministic_algorithms(True)
    try:
        full = run(make_cfg(tmp_path / "a", small_data, **kw))
        part = run(make_cfg(tmp_path / "b", small_data, **kw), stop_after=2)
        rest = run(make_cfg(tmp_path / "b", small_data, resume_from_checkpoint="latest", **kw))
    finally:
        torch.use_deterministic_algorithms(False)
    assert full.losses[-1] < full.losses[0] - 0.3, full.losses  # it trains
    assert part.losses == full.losses[:2]
    assert rest.losses == full.losses[2:], (full.losses, part.losses + rest.losses)  # exact
