"""`optim`: each optimizer trains the tiny preset (a bf16 full fine-tune, where the optimizer decides how weights are
held) and resumes from a DCP checkpoint to the very next-step loss of an uninterrupted run, whose size the disk
check estimated; names and errors."""

from __future__ import annotations

import sys

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.run import checkpoint as ckpt
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


def _bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
@pytest.mark.parametrize("name", ["adamw", "adamw_8bit", "adamw_bf16_sr"])
def test_each_optim_trains_resumes_exactly_and_its_checkpoint_is_as_estimated(tmp_path, small_data, monkeypatch, name):
    """3 steps uninterrupted, saving checkpoint-2, against a resume from it: step 3 gives the same loss (the masters,
    the 8-bit states with their scales, the bf16 states and the RNG of stochastic rounding all restored). The disk
    check's estimate of a checkpoint (`checkpoint.state_estimate` as run/space.py calls it: the masters' fp32 and
    moments, torchao's 8-bit codes and scales, bf16 moments) is within 5% of checkpoint-2's bytes (tokenizer aside,
    which the check adds itself); the AdamW-shaped estimate it replaced was 0.46x (masters) and 1.75x (8-bit)."""
    estimates = []
    real = ckpt.state_estimate
    monkeypatch.setattr(ckpt, "state_estimate", lambda *a, **k: estimates.append(real(*a, **k)) or estimates[-1])
    kw = dict(adapter="full", bf16=True, optim=name, max_steps=3, lora_dropout=0.0, gradient_accumulation_steps=1)
    torch.use_deterministic_algorithms(True)
    try:
        full = run(make_cfg(tmp_path / "a", small_data, save_steps=2, **kw))
        saved = tmp_path / "a" / "checkpoint-2"
        rest = run(make_cfg(tmp_path / "b", small_data, resume_from_checkpoint=str(saved), **kw))
    finally:
        torch.use_deterministic_algorithms(False)
    assert full.losses[-1] < full.losses[0] - 0.3, full.losses  # it trains
    assert len(full.losses) == 3 and rest.losses == full.losses[2:], (full.losses, rest.losses)  # exact
    written = _bytes(saved) - _bytes(saved / "tokenizer")
    assert abs(estimates[0] / written - 1) <= 0.05, (estimates[0], written)
