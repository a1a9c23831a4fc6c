"""A resumed optimizer state is checked for every optim, not only MasterAdamW's (test_optimizer_state.py). A checkpoint
of torch's AdamW or torchao's 8-bit / bf16 AdamW whose state held a negative or NaN second moment, a NaN or Inf first
moment, or a `step` that is negative, NaN, fractional or past the checkpoint's, edited with its checksums redone, was
loaded and trained on: `hybridtune train` stopped at the next step with "the trained weights are not finite; lower
learning_rate", or a negative step a traceback (a complex square root). Each is now one CheckpointError line (exit 2)
naming the checkpoint, the parameter, the state key and what is wrong, before training. A checkpoint another optim
wrote (resumed under --overwrite with the optim changed) failed in one line quoting DCP's internal keys ("Missing key
in checkpoint state_dict: optim.param_groups.0.amsgrad"); it now says which optim saved it, which the config asks for
and what to do. torchao's cases are slow (its step compiles on the CPU)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from resumes import argv, edit_optimizer, interrupted, redo_checksums
from torch import nn

from hybridtune.run import checkpoint as ckpt
from hybridtune.run.checkpoint import CheckpointError
from hybridtune.run.resume import load_checkpoint
from hybridtune.runtime.masters import MasterAdamW, split
from hybridtune.runtime.optim import _Schedule, lr_lambda, torchao_optim
from hybridtune.runtime.optim_state import state_problem
from train_runs import metrics_rows

NAN, INF = float("nan"), float("inf")


def tamper(path, edit, part: str | None = "state") -> None:
    """Edit checkpoint `path`'s optimizer state as someone with write access would: `edit(state)` on DCP's state by
    parameter name (`part` None: on the whole optimizer state, groups too), then every checksum redone (the checkpoint
    verifies)."""
    edit_optimizer(path, lambda state: edit(state[part] if part else state))
    record = json.loads((path / ckpt.META_FILE).read_text())
    redo_checksums(record, path)
    (path / ckpt.META_FILE).write_text(json.dumps(record))
    assert ckpt.verify_checkpoint(path) is None


def setter(name: str, key: str, value):
    """An edit that fills parameter `name`'s state `key` with `value`."""

    def edit(state):
        state[name][key] = torch.full_like(state[name][key], value)

    return edit


# -- the checkpoint alone: a small model, each optim, its cosine schedule, checkpoint-3 ---------------------------


def build(optim: str, seed: int):
    """(model, optimizer, schedule) of `optim`: torch's AdamW (fp32), MasterAdamW (bf16 weights, fp32 masters) or
    torchao's on bf16 weights (0.weight, 64 x 128, is the one large enough for 8-bit state)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 7))
    if optim == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    elif optim == "masters":
        split(model)
        opt = MasterAdamW(list(model.parameters()), lr=1e-3, weight_decay=0.01)
    else:
        model.to(torch.bfloat16)
        ao = torchao_optim()
        opt = ao.AdamW8bit(model.parameters(), lr=1e-3) if optim == "adamw_8bit" else None
        opt = opt or ao._AdamW(model.parameters(), lr=1e-3, bf16_stochastic_round=True)
    return model, opt, _Schedule(opt, lr_lambda("cosine", 2, 10))


def steps(model, opt, sched, n: int, only_first: bool = False) -> None:
    dtype = next(model.parameters()).dtype
    for _ in range(n):
        x = torch.randn(5, 128, dtype=dtype)
        # `only_first`: the last layer has no gradient (as a vision tower under text rows): its state lags
        loss = model[:2](x).float().pow(2).mean() if only_first else model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def saved(out, optim: str = "adamw", lagging: bool = False):
    """checkpoint-3 of a 3-step run of `optim` in `out`, recording its optim as the trainer does. `lagging`: the last
    layer has a gradient in the first step only."""
    out.mkdir(parents=True, exist_ok=True)
    model, opt, sched = build(optim, 0)
    steps(model, opt, sched, 1)
    steps(model, opt, sched, 2, only_first=lagging)
    extra = {"run": {"config": {"optim": "adamw" if optim == "masters" else optim}}}
    return ckpt.save_checkpoint(out / "checkpoint-3", model, opt, sched, 3, {"epoch": 0, "index": 3}, extra=extra)


def refused(path, optim: str = "adamw") -> str:
    model, opt, sched = build(optim, 1)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path, model, opt, sched)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"checkpoint '{path}' cannot be resumed: "), msg
    return msg


STATES = {  # what is edited -> (the edit, what the line must say after "its optimizer state of parameter ")
    "negative second moment": (setter("0.weight", "exp_avg_sq", -1.0), r"'0\.weight': 'exp_avg_sq' holds a negative"),
    "NaN second moment": (setter("2.weight", "exp_avg_sq", NAN), r"'2\.weight': 'exp_avg_sq' holds NaN"),
    "NaN first moment": (setter("0.bias", "exp_avg", NAN), r"'0\.bias': 'exp_avg' holds NaN"),
    "Inf first moment": (setter("0.weight", "exp_avg", -INF), r"'0\.weight': 'exp_avg' holds Inf"),
    "negative step": (setter("2.bias", "step", -1.0), r"'2\.bias': 'step' is -1, not a count of steps"),
    "NaN step": (setter("0.weight", "step", NAN), r"'0\.weight': 'step' holds NaN"),
    "fractional step": (setter("0.weight", "step", 2.5), r"'0\.weight': 'step' is 2\.5, not a count of steps"),
    "a step past the checkpoint's": (
        setter("2.weight", "step", 7.0),
        r"'2\.weight': 'step' is 7 but the checkpoint is at step 3",
    ),
    "every step behind the checkpoint's": (
        lambda s: [v.__setitem__("step", torch.zeros(())) for v in s.values()],
        r"every parameter: 'step' is at most 0 but the checkpoint is at step 3",
    ),
}


@pytest.mark.parametrize("case", list(STATES))
def test_torch_adamw_state_that_cannot_train_is_one_line(tmp_path, case):
    edit, said = STATES[case]
    path = saved(tmp_path)
    tamper(path, edit)
    msg = refused(path)
    whose = "" if said.startswith("every") else "parameter "
    assert re.search(f"its optimizer state of {whose}{said}", msg), msg
    assert msg.endswith("resume from a checkpoint you trust, or start the run again with --overwrite"), msg


def test_a_state_of_another_shape_is_one_line(tmp_path):
    """DCP refuses a saved tensor of another shape than the state it loads into (which is shaped as its parameter);
    `state_problem` refuses one that reached it, by parameter and key."""
    path = saved(tmp_path)
    tamper(path, lambda s: s["0.weight"].__setitem__("exp_avg_sq", torch.zeros(3)))
    assert "Size mismatch" in refused(path) and "0.weight.exp_avg_sq" in refused(path)
    params = {"w": torch.zeros(2, 3)}
    osd = {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3, 2), "exp_avg_sq": torch.zeros(2, 3)}}}
    said = state_problem(osd, params, 1)
    assert said.startswith("its optimizer state of parameter 'w': 'exp_avg' has shape (3, 2) where the parameter's"), (
        said
    )
    osd["state"]["w"]["step"] = torch.ones(2)
    assert "'step' has shape (2,), not one number" in state_problem(osd, params, 1)


def test_masteradamw_state_is_checked_the_same_way(tmp_path):
    """MasterAdamW's own load refuses NaN and negative moments; a bad step, which it took, is now refused too."""
    path = saved(tmp_path, "masters")
    tamper(path, setter("0.weight", "step", -2.0))
    assert "parameter '0.weight': 'step' is -2, not a count of steps" in refused(path, "masters")


def test_an_untouched_state_resumes_exactly_and_a_lagging_step_is_no_error(tmp_path):
    """A parameter without a gradient in some steps has a smaller step than its checkpoint (torch skips it): legal."""
    path = saved(tmp_path, lagging=True)
    model, opt, sched = build("adamw", 1)
    load_checkpoint(path, model, opt, sched)
    held = {k: v for k, v in zip(("0.weight", "0.bias", "2.weight", "2.bias"), opt.state.values())}
    assert [float(v["step"]) for v in held.values()] == [3.0, 3.0, 1.0, 1.0]
    ref_model, ref_opt, ref_sched = build("adamw", 0)
    steps(ref_model, ref_opt, ref_sched, 1)
    steps(ref_model, ref_opt, ref_sched, 2, only_first=True)
    for want, got in zip(ref_opt.state.values(), opt.state.values()):
        assert all(torch.equal(want[k], got[k]) for k in want)


def test_a_group_key_the_checkpoint_lacks_resumes_as_the_configs(tmp_path):
    """A checkpoint of an older torch, whose AdamW groups had no `decoupled_weight_decay`, was refused as another
    optim's: "it was saved with optim adamw and this run's config asks for adamw ... group 0 lacks
    'decoupled_weight_decay'". Group keys are the config's after the load: it resumes, exactly, with this run's."""
    path = saved(tmp_path)
    tamper(path, lambda optim: optim["param_groups"][0].pop("decoupled_weight_decay"), part=None)
    model, opt, sched = build("adamw", 1)
    assert load_checkpoint(path, model, opt, sched)["step"] == 3
    assert opt.param_groups[0]["decoupled_weight_decay"] is True
    ref_model, ref_opt, ref_sched = build("adamw", 0)
    steps(ref_model, ref_opt, ref_sched, 3)
    torch.manual_seed(3)
    steps(model, opt, sched, 1)
    torch.manual_seed(3)
    steps(ref_model, ref_opt, ref_sched, 1)
    assert all(torch.equal(a, b) for a, b in zip(ref_model.parameters(), model.parameters()))


TORCHAO = pytest.mark.slow  # (torchao's step compiles on the CPU)
OPTIMS = ["adamw", "masters", *(pytest.param(o, marks=TORCHAO) for o in ("adamw_8bit", "adamw_bf16_sr"))]


@pytest.mark.parametrize("optim", OPTIMS)
def test_a_checkpoint_saved_before_the_first_step_resumes_as_never_stepped(tmp_path, optim):
    """Ctrl-C in the first step saves checkpoint-0. torch's get_state_dict made torch's and torchao's state for it by
    a step at lr 0 (every `step` 1); resumed, the optimizer's count ran one ahead of the trainer's (Adam's bias
    correction with it) and the next checkpoint was refused: "'step' is 2 but the checkpoint is at step 1". Now the
    chain checkpoint-0, one step, checkpoint-1, one step is the uninterrupted run, state and weights."""
    if optim.startswith("adamw_"):
        pytest.importorskip("torchao.optim")
    model, opt, sched = build(optim, 0)
    zero = ckpt.save_checkpoint(tmp_path / "checkpoint-0", model, opt, sched, 0, {"epoch": 0, "index": 0})
    model, opt, sched = build(optim, 1)
    assert load_checkpoint(zero, model, opt, sched)["step"] == 0
    assert {float(v["step"]) for v in opt.state.values()} <= {0.0}  # none yet, or MasterAdamW's at 0
    steps(model, opt, sched, 1)  # (checkpoint-0's RNG: the uninterrupted run's batch)
    one = ckpt.save_checkpoint(tmp_path / "checkpoint-1", model, opt, sched, 1, {"epoch": 0, "index": 1})
    model, opt, sched = build(optim, 2)
    assert load_checkpoint(one, model, opt, sched)["step"] == 1
    assert {float(v["step"]) for v in opt.state.values()} == {1.0}
    steps(model, opt, sched, 1)
    ref_model, ref_opt, ref_sched = build(optim, 0)
    steps(ref_model, ref_opt, ref_sched, 2)
    for want, got in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(want, got)
    for want, got in zip(ref_opt.state.values(), opt.state.values()):
        assert want.keys() == got.keys() and float(got["step"]) == 2
        for k in want:
            a, b = (x.dequantize() if hasattr(x, "dequantize") else x for x in (want[k], got[k]))
            assert torch.equal(a, b), k


def test_a_step_past_a_first_step_checkpoint_is_refused():
    """No step is allowed past checkpoint-0's (its fake step's state is dropped before the check, never let by)."""
    params = {"w": torch.zeros(2)}
    osd = {"state": {"w": {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2), "exp_avg_sq": torch.zeros(2)}}}
    assert "'step' is 1 but the checkpoint is at step 0" in state_problem(osd, params, 0)
    osd["state"]["w"]["step"] = torch.tensor(0.0)
    assert state_problem(osd, params, 0) is None


def test_a_checkpoint_another_optim_wrote_names_both_optims(tmp_path):
    """MasterAdamW's checkpoint (bf16) into torch's AdamW (fp32): DCP said "Missing key ... optim.param_groups.0.amsgrad"."""
    path = saved(tmp_path, "masters")
    msg = refused(path)
    assert "it was saved with optim adamw (fp32 masters) and this run's config asks for adamw:" in msg, msg
    assert "'master', which this run's has not" in msg and "optim.param_groups" not in msg, msg
    assert "keep the bf16, adapter and distributed settings it was written with to resume it" in msg, msg
    assert "or start the run afresh (--overwrite without resume_from_checkpoint)" in msg, msg


AO_STATES = {  # 0.weight's state is 8-bit under adamw_8bit: its NaN and Inf show in its block scales
    "adamw_8bit NaN first moment": (
        "adamw_8bit",
        setter("0.weight", "exp_avg", NAN),
        r"'0\.weight': 'exp_avg' holds NaN",
    ),
    "adamw_8bit Inf second moment": (
        "adamw_8bit",
        setter("0.weight", "exp_avg_sq", INF),
        r"'0\.weight': 'exp_avg_sq' holds Inf",
    ),
    "adamw_8bit negative step": (
        "adamw_8bit",
        setter("0.weight", "step", -3.0),
        r"'0\.weight': 'step' is -3, not a count",
    ),
    "adamw_bf16_sr negative second moment": (
        "adamw_bf16_sr",
        setter("0.weight", "exp_avg_sq", -1.0),
        r"'0\.weight': 'exp_avg_sq' holds a negative value \(-1\)",
    ),
    "adamw_bf16_sr step past the checkpoint's": (
        "adamw_bf16_sr",
        setter("2.bias", "step", 4.0),
        r"'2\.bias': 'step' is 4 but the checkpoint is at step 3",
    ),
}


@TORCHAO
@pytest.mark.parametrize("case", list(AO_STATES))
def test_torchao_state_that_cannot_train_is_one_line(tmp_path, case):
    pytest.importorskip("torchao.optim")
    optim, edit, said = AO_STATES[case]
    path = saved(tmp_path, optim)
    tamper(path, edit)
    msg = refused(path, optim)
    assert re.search(f"its optimizer state of parameter {said}", msg), msg


@TORCHAO
def test_torchao_8bit_state_resumes_quantised_and_exact(tmp_path):
    pytest.importorskip("torchao.optim")
    path = saved(tmp_path, "adamw_8bit")
    model, opt, sched = build("adamw_8bit", 1)
    load_checkpoint(path, model, opt, sched)
    big = opt.state[model[0].weight]["exp_avg_sq"]
    assert hasattr(big, "codes") and big.codes.dtype == torch.uint8  # still 8-bit, not a dequantised copy
    ref_model, ref_opt, ref_sched = build("adamw_8bit", 0)
    steps(ref_model, ref_opt, ref_sched, 3)
    want = ref_opt.state[ref_model[0].weight]
    assert (
        torch.equal(big.dequantize(), want["exp_avg_sq"].dequantize())
        and float(opt.state[model[0].weight]["step"]) == 3
    )


@TORCHAO
def test_torchao_checkpoint_into_torch_adamw_names_both_optims(tmp_path):
    """torchao's groups hold the rates as tensors, torch's as numbers: DCP said "Missing key ... param_groups.0.foreach"
    (the group keys torchao's lack: now this run's), then "Invalid checkpoint metadata for optim.param_groups.0.lr"."""
    pytest.importorskip("torchao.optim")
    path = saved(tmp_path, "adamw_bf16_sr")
    msg = refused(path)
    assert "it was saved with optim adamw_bf16_sr and this run's config asks for adamw:" in msg, msg
    assert "group 0 holds 'lr', 'initial_lr' as a tensor, this run's as a number" in msg, msg
    assert "keep optim: adamw_bf16_sr to resume it" in msg and "metadata" not in msg, msg


# -- the trainer: the tiny preset, stopped after its first step, resumed through `hybridtune train` --------------

EMBED = "model.model.embed_tokens.weight"  # (its name in the checkpoint: under the trainer's LossModule)


TRAINER = {
    "negative second moment": (setter(EMBED, "exp_avg_sq", -1.0), "'exp_avg_sq' holds a negative value (-1)"),
    "negative step": (setter(EMBED, "step", -5.0), "'step' is -5, not a count of steps"),
}


@pytest.mark.parametrize("case", list(TRAINER))
def test_train_refuses_a_tampered_state_in_one_line(copied, error_line, case):
    """Was: trained on, then "step 2: the trained weights are not finite ... lower learning_rate" (exit 3), or for
    the negative step a traceback from torch's AdamW (a complex square root)."""
    out, given = copied
    edit, said = TRAINER[case]
    tamper(out / "checkpoint-1", edit)
    line = error_line(argv(given))
    assert f"checkpoint '{out / 'checkpoint-1'}' cannot be resumed: its optimizer state of parameter '{EMBED}'" in line
    assert said in line, line
    assert not (out / "checkpoint-2").exists() and len(metrics_rows(out, "train")) == 1


def test_train_under_another_optim_setup_says_which_in_one_line(tmp_path, small_data, error_line):
    """bf16 (MasterAdamW's fp32 masters in its state) resumed with bf16 off under --overwrite (torch's AdamW)."""
    given = interrupted(tmp_path / "run", small_data, bf16=True)
    line = error_line(argv({**given, "bf16": False}, "--overwrite"))
    assert "it was saved with optim adamw (fp32 masters) and this run's config asks for adamw:" in line, line
    assert "Missing key" not in line and "optim.param_groups" not in line, line


@TORCHAO
def test_train_with_another_optim_says_which_in_one_line(tmp_path, small_data, error_line):
    """The red team's case: adamw_bf16_sr's checkpoint resumed under optim: adamw and --overwrite."""
    pytest.importorskip("torchao.optim")
    given = interrupted(tmp_path / "run", small_data, bf16=True, optim="adamw_bf16_sr")
    line = error_line(argv({**given, "optim": "adamw"}, "--overwrite"))
    assert "it was saved with optim adamw_bf16_sr and this run's config asks for adamw (fp32 masters):" in line, line
    assert "lacks 'master'" in line and "keep optim: adamw_bf16_sr to resume it" in line, line
    assert "Missing key" not in line, line
