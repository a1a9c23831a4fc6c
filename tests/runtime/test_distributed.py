"""Two processes (torchrun, gloo, CPU) train what one process trains; their checkpoints resume in one process;
a rank that dies ends the run with one line and leaves the last checkpoint loadable.

Tolerances. The 2-process run computes the same micro-batches as the 1-process run with the same global
batch (gradient_accumulation_steps 4 = 2 per rank); only the order of fp32 sums differs: rank partial sums
of the loss and the gradients, DDP's all-reduce, FSDP2's reduce-scatter and the sharded grad-norm. Measured
differences are ~1e-7 relative on the loss and ~2e-6 on the grad norm after 4 AdamW steps; the bounds below
(1e-5 and 1e-4) leave room for other CPUs while any real error is orders larger: a wrong token count or a
missing rank share changes the loss by percent, a gradient scaled by the world size doubles the grad norm
(the loss alone would not show it: AdamW and clipping are scale-invariant).

Eval is sharded over the ranks and its sums all-reduced. Before the first step the weights are the same
bits on every rank and in one process, so the eval loss differs only by the order of float64 sums
(EVAL_RTOL_STEP0 = 1e-9; measured ~1e-16); after training it inherits the weights' rounding (LOSS_RTOL).
Counts (examples, exact matches) are integers and must be equal; a missing or doubled shard changes them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torchrun_runs import (
    ENV,
    EVAL_RTOL_STEP0,
    GRAD_NORM_RTOL,
    LOSS_RTOL,
    STEPS,
    args,
    assert_same_curve,
    records,
    settings,
    train_here,
)

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.run import checkpoint as ckpt
from hybridtune.runtime import distributed, engines
from hybridtune.runtime.adapter_kind import FULL, LORA

KINDS = {"lora": LORA, "full": FULL}


def eval_packs(data: str) -> int:
    """The number of eval packs of `settings(data, ...)` (the held-out examples packed as `evaluate` packs them)."""
    from hybridtune.data.build import prepare
    from hybridtune.models.loading import tokenizer_for
    from hybridtune.train.evaluation import eval_batches

    cfg = load_config(None, settings(data, "lora", output_dir="unused"))
    examples = prepare(cfg, tokenizer_for(cfg.base_model, cfg.tokenizer)).eval_examples
    return len(list(eval_batches(examples[: cfg.eval_max_examples], cfg.sequence_len)))


@pytest.fixture
def launch():
    """`hybridtune train --nproc 2 ARGS` in the background; whatever is left of it is ended after the test."""
    started = []

    def start(*argv: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridtune", "train", "--nproc", "2", *argv],
            env=ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the launcher and its ranks
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, small_data):
    """adapter -> the output directory of the 1-process run of `settings(small_data, adapter)`, trained on first
    request and then only read: it is the same run for every engine and unit layout the 2-process runs take."""
    runs: dict[str, Path] = {}

    def run(adapter: str) -> Path:
        if adapter not in runs:
            out = tmp_path_factory.mktemp("one") / adapter
            train_here(settings(small_data, adapter, output_dir=out))
            runs[adapter] = out
        return runs[adapter]

    return run


@pytest.mark.slow
@pytest.mark.torchrun  # twice
@pytest.mark.parametrize(
    "adapter,engine,units",
    [
        ("lora", "ddp", "auto"),
        ("lora", "fsdp", "auto"),
        ("full", "fsdp", "auto"),
        ("full", "fsdp", "model"),
        ("full", "fsdp", "group:2"),
    ],
)
def test_two_processes_equal_one_and_resume_in_one(tmp_path, small_data, launch, one_process, adapter, engine, units):
    """fsdp_units auto on the CPU (compile off) is per layer; `model` reduces the gradients once per window. LoRA
    under FSDP2 builds its base on the meta device as a full fine-tune does, its adapter drawn as in one process."""
    two = tmp_path / "two"
    # distributed: auto picks `engine` where it can (LoRA under FSDP2 is asked for); the last step is profiled on
    # both ranks (and must change nothing)
    asked = {} if distributed.choose_engine("auto", KINDS[adapter]) == engine else {"distributed": engine}
    proc = launch(*args(settings(small_data, adapter, output_dir=two, profile_steps=1, fsdp_units=units, **asked)))
    first = one_process(adapter)  # trained while the ranks start (the adapter's first case), read only
    one = records(first)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"x 2 processes ({engine})" in err
    if engine == "fsdp":
        said = {"model": "FSDP2: the whole model as one unit", "group:2": "groups of decoder layers (2/"}.get(
            units, "decoder layers + the rest"
        )
        assert said in err, err
        # built on the meta device, each rank filling its own shards (runtime/model.py, engines.wrap); under LoRA
        # the model is the fp32 base (bf16 is off on the CPU) and the adapter, both sharded
        held = {"full": "1.7 MiB of the model's 3.3 MiB", "lora": "1.9 MiB of the model's 3.9 MiB"}[adapter]
        assert f"sharded load: rank 1 holds {held}" in err, err
    assert_same_curve(records(two), one)
    assert len(one) == STEPS
    assert all(r["mem_gib"] > 0 for r in records(two))
    prof = json.loads((two / f"profile-{STEPS}-{STEPS}.json").read_text())
    assert prof["steps"] == [STEPS, STEPS] and prof["world"] == 2
    assert len(prof["ranks"]) == 2 and all(p["wall_ms_per_step"] > 0 for p in prof["ranks"])

    # Eval (before the first step and at the end), each rank on its share of an odd number of packs.
    assert eval_packs(small_data) % 2 == 1
    got, want = records(two, "eval"), records(first, "eval")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, STEPS]
    for g, w, rtol in zip(got, want, (EVAL_RTOL_STEP0, LOSS_RTOL)):
        assert g["eval_examples"] == w["eval_examples"] == 8, (got, want)
        assert g["exact_match"] == w["exact_match"], (got, want)
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=rtol), (got, want)

    # The 2-process checkpoint at step 2 continues in one process along the same curve.
    assert (two / "checkpoint-2" / "rng-1.pt").is_file()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(two / "checkpoint-2", resumed / "checkpoint-2")
    rest = train_here(settings(small_data, adapter, output_dir=resumed, resume_from_checkpoint="latest"))
    assert_same_curve(rest, one[2:])

    # And the other way: the 1-process checkpoint at step 2 continues in 2 processes along the same curve (DCP
    # reshards the whole tensors into this engine's layout: DDP, FSDP2 per layer, FSDP2 whole-model). Dropout is 0,
    # so rank 1's missing RNG file is moot.
    again = tmp_path / "again"
    again.mkdir()
    shutil.copytree(first / "checkpoint-2", again / "checkpoint-2")
    s = settings(small_data, adapter, output_dir=again, resume_from_checkpoint="latest", fsdp_units=units, **asked)
    proc = launch(*args(s))
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "resumed from" in err and "written by 1 process(es)" in err, err
    assert_same_curve(records(again), one[2:])

    # The final export is whole (gathered from the shards under FSDP2): the 1-process export, key for key
    # (tied lm_head written once), and it loads in transformers.
    from safetensors.torch import load_file

    weights = "adapter_model.safetensors" if adapter == "lora" else "model.safetensors"
    got, want = (load_file(str(d / "final" / weights)) for d in (two, first))
    assert sorted(got) == sorted(want)
    # The weights move ~1e-3 in 4 steps; the two runs differ by rounding only.
    assert max(float((got[k] - want[k]).abs().max()) for k in want) < 1e-5
    if adapter == "full":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(two / "final")
        assert model.num_parameters() == pytest.approx(0.9e6, rel=0.2)  # the tiny preset, not one shard of it


# One torchrun launch (2 gloo ranks on the CPU) serves the three checks below: the compiled loop under FSDP2 and
# DDP, FSDP2's whole-model unit over a window, and the collectives `mem_gib` and eval take. Each check is a
# function of its own here; every rank writes what it found to rank<k>.json (stdout interleaves).
RANKS = """
import contextlib, dataclasses, json, pathlib, sys, torch
from hybridtune.compiler.loop import compile_loop
from hybridtune.data import PackedCollator
from hybridtune.data.packing import Example
from hybridtune.models.loading import load_model
from hybridtune.models.patching import patch_model
from hybridtune.runtime import distributed, engines
from hybridtune.runtime.adapter_kind import FULL
from hybridtune.train.objectives import SFT

OUT, BACKEND = pathlib.Path(sys.argv[1]), sys.argv[2]
PACKS = [(65, 23), (40, 23, 9), (90, 30), (12, 7, 50)]  # a new pack layout every micro-batch

def batch(sizes):
    return PackedCollator()([Example(list(range(5, 5 + n)), [1] * n) for n in sizes])

def compiled_loop(d):
    torch.manual_seed(0)
    model = load_model("tiny-qwen3_5").model
    patch_model(model)
    # The compiled loop is one graph over every layer: FSDP2 shards the model as one unit under it.
    wrapped = engines.wrap(distributed.LossModule(model, SFT(fused=True)), d, torch.device("cpu"), False)
    mine = PACKS[d.rank :: d.world]

    def step(sizes):
        loss = wrapped(batch(sizes), 100)
        (loss * d.world).backward()
        norm = distributed.total_grad_norm(list(wrapped.parameters()))
        for p in wrapped.parameters():
            p.grad = None
        return float(loss), float(norm)

    eager = [step(s) for s in mine]
    handle = compile_loop(model, backend=BACKEND, fullgraph=True)  # the loop strategy, minus inductor
    torch._dynamo.reset()  # the other engine's model compiled the same code object
    torch._dynamo.utils.counters.clear()
    compiled = [step(s) for s in mine]
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return {"eager": eager, "compiled": compiled, "graphs": graphs, "compiled_calls": handle.calls}

@contextlib.contextmanager
def counted_collectives(calls):
    dist = torch.distributed
    names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, f in saved.items():  # FSDP2 calls them through the module (torch 2.13: *_single; earlier: *_tensor)
        def counted(*a, _f=f, _k="gather" if "gather" in name else "reduce", **kw):
            calls[_k] += 1
            return _f(*a, **kw)
        setattr(dist, name, counted)
    try:
        yield
    finally:
        for name, f in saved.items():
            setattr(dist, name, f)

def window(d, windowed):
    torch.manual_seed(0)
    model = load_model("tiny-qwen3_5").model
    wrapped = engines.wrap(distributed.LossModule(model, SFT(fused=True)), d, torch.device("cpu"), False)
    packs = PACKS[d.rank :: d.world]  # 2 micro-batches per rank
    calls = {"gather": 0, "reduce": 0}
    with counted_collectives(calls):
        for i, sizes in enumerate(packs):
            last = i == len(packs) - 1
            ctx = engines.accumulation(wrapped, d, last) if windowed else contextlib.nullcontext()
            with ctx:
                (wrapped(batch(sizes), 300) * d.world).backward()
    # Every parameter's whole gradient (FSDP2's are DTensor shards: gathered), in one order on every engine.
    grads = {}
    for name, p in wrapped.named_parameters():
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        grads[name.removeprefix("module.")] = g.detach().flatten()
    norm = float(distributed.total_grad_norm(list(wrapped.parameters())))
    return {"norm": norm, **calls}, grads

def windows(d):
    res, grads = {}, {}
    for key, dd, windowed in [
        ("ddp", dataclasses.replace(d, engine="ddp"), True),
        ("per_micro_batch", dataclasses.replace(d, units="model"), False),
        ("per_window", dataclasses.replace(d, units="model"), True),
    ]:
        res[key], grads[key] = window(dd, windowed)
    # The largest element-wise difference from DDP's gradient, relative to that gradient's largest element.
    for key in ("per_micro_batch", "per_window"):
        assert grads[key].keys() == grads["ddp"].keys(), (key, sorted(grads[key])[:3], sorted(grads["ddp"])[:3])
        res[key]["grad_rel_diff"] = max(
            float((grads[key][n] - g).abs().max() / g.abs().max().clamp(min=1e-30)) for n, g in grads["ddp"].items()
        )
    return res

d = distributed.init("fsdp", FULL, "cpu")
got = {
    "compiled_loop": {e: compiled_loop(dataclasses.replace(d, engine=e, units="model")) for e in ("fsdp", "ddp")},
    "window": windows(d),
    "collectives": {"max": distributed.all_max(0.25 + d.rank, d), "sum": distributed.all_sum([1.5, d.rank], d)},
}
(OUT / f"rank{d.rank}.json").write_text(json.dumps(got))
distributed.shutdown(d)
"""


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of 2 torchrun ranks found running RANKS (launched once for every test that asks)."""
    out = tmp_path_factory.mktemp("ranks")
    script = out / "ranks.py"
    script.write_text(RANKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    r = subprocess.run([*cmd, str(out), "eager"], env=ENV, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((out / f"rank{k}.json").read_text()) for k in (0, 1)]


@pytest.mark.slow
@pytest.mark.torchrun
def test_compiled_loop_inside_fsdp2_and_ddp(ranks):
    """The compiled `loop` strategy (one graph, patched GDN ops) runs under FSDP2 and DDP as eager does.

    Dynamo's `eager` backend: the capture (one graph, no break at FSDP2's hooks, no recompile across pack
    layouts) is what the engines could disturb; inductor's CPU build would cost minutes. `aot_eager` gives
    the same numbers (checked by hand with RANKS, `aot_eager` as its second argument).
    """
    for engine, res in ranks[0]["compiled_loop"].items():
        for (le, ne), (lc, nc) in zip(res["eager"], res["compiled"]):
            assert lc == pytest.approx(le, rel=LOSS_RTOL) and nc == pytest.approx(ne, rel=GRAD_NORM_RTOL), engine
        assert res["graphs"] == 1 and res["compiled_calls"] == 2, (engine, res)  # no break, no recompile


@pytest.mark.slow
@pytest.mark.torchrun
def test_fsdp2_whole_model_unit_reduces_once_per_window(ranks):
    """FSDP2 with the whole model as one unit (`fsdp_units: model`, what the compiled loop uses): over a window of
    2 micro-batches per rank, one all-gather and one reduce-scatter (not one of each per micro-batch), and the
    accumulated gradient is DDP's and the per-micro-batch sync's, element by element (GRAD_NORM_RTOL)."""
    res = ranks[0]["window"]
    assert res["per_micro_batch"]["gather"] == 2 and res["per_micro_batch"]["reduce"] == 2, res
    assert res["per_window"]["gather"] == 1 and res["per_window"]["reduce"] == 1, res
    for key in ("per_micro_batch", "per_window"):
        assert res[key]["norm"] == pytest.approx(res["ddp"]["norm"], rel=GRAD_NORM_RTOL), res
        assert res[key]["grad_rel_diff"] < GRAD_NORM_RTOL, res  # every parameter's gradient, element by element


def worker_pids(root: int) -> dict[int, int]:
    """rank -> pid of the torchrun workers under process `root` (Linux /proc)."""
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
        try:
            env = dict(
                kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0") if "=" in kv
            )
        except OSError:
            continue
        if pid != root and "RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            found[int(env["RANK"])] = pid
    return found


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank processes through Linux /proc")
def test_dead_rank_ends_the_run_with_one_line(tmp_path, small_data, launch):
    out = tmp_path / "run"
    s = settings(small_data, "lora", output_dir=out, max_steps=10_000)
    proc = launch(*args(s))
    pids = _run_until_a_checkpoint(proc, out)
    os.kill(pids[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=120)  # never a hang: torchrun stops rank 0
    assert proc.returncode == 1, err
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert last.startswith("error: ") and "rank 1" in last and "SIGKILL" in last, err

    # The last complete checkpoint resumes in one process.
    done = ckpt.list_checkpoints(out)[-1]
    step = int(done.name.split("-")[1])
    rest = train_here(
        {**s, "resume_from_checkpoint": str(done), "max_steps": step + 1, "save_steps": 0, "overwrite": True}
    )
    assert rest[-1]["step"] == step + 1  # metrics.jsonl continues the killed run's
    assert not list(out.glob(".tmp-*"))  # whatever the killed ranks left half-written is gone


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state  # a zombie has ended; only its parent has not reaped it


def _run_until_a_checkpoint(proc, out: Path) -> dict[int, int]:
    deadline = time.monotonic() + 240
    while not ckpt.list_checkpoints(out):
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no checkpoint within 240 s"
        time.sleep(0.2)
    pids = worker_pids(proc.pid)
    assert sorted(pids) == [0, 1], pids
    return pids


@pytest.mark.slow
@pytest.mark.torchrun
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank processes through Linux /proc")
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path, small_data, launch):
    """Issue 16 item 4: SIGKILL of the `--nproc` launcher left both ranks running as orphans that kept writing into
    the output directory. Each rank now gets SIGTERM when its launcher dies (it saves, then exits)."""
    out = tmp_path / "run"
    proc = launch(*args(settings(small_data, "lora", output_dir=out, max_steps=10_000)))
    pids = _run_until_a_checkpoint(proc, out)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    deadline = time.monotonic() + 90
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [r for r, p in pids.items() if _alive(p)], "ranks outlived their launcher"
    # Nothing writes into the directory any more: a resume there may start (its lock is free).
    before = (out / "metrics.jsonl").read_text()
    time.sleep(2)
    assert (out / "metrics.jsonl").read_text() == before


@pytest.mark.slow
@pytest.mark.torchrun  # and a collective timeout
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the rank processes through Linux /proc")
def test_a_stalled_rank_is_blamed_not_the_one_that_waited_for_it(tmp_path, small_data):
    """Issue 16 item 17: a stopped rank (SIGSTOP) made the other time out in a collective, and the one line blamed
    the rank that timed out."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hybridtune",
            "train",
            "--nproc",
            "2",
            *args(settings(small_data, "lora", output_dir=out, max_steps=10_000)),
        ],
        env={**ENV, "HYBRIDTUNE_DIST_TIMEOUT_S": "10"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        pids = _run_until_a_checkpoint(proc, out)
        os.kill(pids[1], signal.SIGSTOP)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert last.startswith("error: rank 1 ") and "rank 0 then timed out waiting for it" in last, err[-3000:]


@pytest.mark.slow
@pytest.mark.torchrun
def test_plain_torchrun_says_a_rank_input_error_in_one_line_without_its_traceback(tmp_path):
    """Issue 16 item 17: under plain torchrun a rank's UserError reached torchrun's report as a traceback (the
    rank's error file). Now rank 0 says it in one line; torchrun's own report (its banner) stays torchrun's."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "wizard", "content": "x"}]}\n')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "hybridtune"]
    cmd += ["train", "--device", "cpu", "--max_steps", "1", "--gradient_accumulation_steps", "2", "--dataset"]
    r = subprocess.run(
        [*cmd, str(bad), "--output_dir", str(tmp_path / "o")], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert r.returncode != 0
    said = [x for x in r.stderr.splitlines() if x.startswith("error: ")]
    assert len(said) == 1 and "unknown role 'wizard'" in said[0], r.stderr[-3000:]
    assert "copy child error file" not in r.stderr and "DataError" not in r.stderr, r.stderr[-3000:]
    assert not (tmp_path / "o").exists()  # a refused run leaves nothing


@pytest.mark.slow
@pytest.mark.torchrun
def test_nproc_says_a_rank_input_error_in_one_line_without_torchruns_lines(tmp_path, launch):
    """Issue 16 item 17: under --nproc, 5-6 torchrun log lines surrounded the one line (and the launcher said the
    config's warnings a second time)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "wizard", "content": "x"}]}\n')
    proc = launch("--device", "cpu", "--max_steps", "1", "--gradient_accumulation_steps", "2", "--dataset", str(bad),
                  "--output_dir", str(tmp_path / "o"))  # fmt: skip
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, err
    assert "torch/distributed" not in err and "exitcode" not in err, err
    assert [x for x in err.splitlines() if x.startswith("error: ")] == [err.strip().splitlines()[-1]]
    assert err.count("not shorter than the run") == 1  # the warmup warning, once


def test_a_rank_other_than_0_leaves_its_input_mistake_to_rank_0(monkeypatch, capsys):
    """CI caught the race: rank 1 met the bad row first and exited 2, torchrun stopped rank 0 before it said the
    error (rank 0 exited 130 with "interrupted"), and the launcher blamed the ranks instead of the input. A rank other
    than 0 now waits for rank 0 to say it (torchrun stops it then); a mistake of its own it says after the wait, and
    the launcher counts a rank stopped during setup (130) or training (143) as stopped."""
    from hybridtune import cli
    from hybridtune.errors import DataError
    from hybridtune.train import command

    monkeypatch.setattr(command, "RANK0_GRACE_S", 0.3)
    t = time.monotonic()
    command._after_rank0(DataError("d.jsonl:1: unknown role 'wizard'"))
    assert time.monotonic() - t >= 0.3
    assert capsys.readouterr().err == "error: d.jsonl:1: unknown role 'wizard'\n"
    assert command.input_mistake({2, 130}) and command.input_mistake({2, -signal.SIGTERM, 143})
    assert not command.input_mistake({2, 1}) and not command.input_mistake({-signal.SIGKILL, 2})

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(command, "main", interrupted)
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["train"]) == 130 and capsys.readouterr().err == ""  # rank 0 speaks for the run
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train"]) == 130 and capsys.readouterr().err == "interrupted\n"


def test_window_must_split_evenly_before_any_launch(tmp_path):
    """3 micro-batches cannot split over 2 ranks without changing the global batch: refused up front."""
    from hybridtune.errors import ConfigError
    from hybridtune.train.command import main

    with pytest.raises(ConfigError, match="gradient_accumulation_steps' = 3 is not a multiple of the 2 processes"):
        main(["--nproc", "2", "--gradient_accumulation_steps", "3", "--output_dir", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


def test_cuda_without_gpus_is_refused_before_any_launch(tmp_path, monkeypatch):
    from hybridtune.train.command import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA GPU is visible"):
        main(["--nproc", "2", "--gradient_accumulation_steps", "2", "--device", "cuda", "--output_dir", str(tmp_path)])


def test_more_ranks_than_gpus_is_refused_before_any_launch(tmp_path, monkeypatch):
    from hybridtune.train.command import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"--nproc 2 needs 2 GPUs but 1 are visible"):
        main(["--nproc", "2", "--gradient_accumulation_steps", "2", "--output_dir", str(tmp_path)])


def test_rng_state_round_trip(tmp_path):
    from hybridtune.run.rng import rng_state, set_rng_state

    torch.manual_seed(3)
    state = rng_state()
    want = torch.rand(4)
    torch.manual_seed(99)
    set_rng_state(state)
    assert torch.equal(torch.rand(4), want)


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_eval_shares_are_disjoint_and_cover_every_pack(engine):
    for world in (1, 2, 3, 4):
        for n in range(8):
            shares = [distributed.eval_share(n, distributed.Dist(r, world, engine=engine)) for r in range(world)]
            assert sorted(i for s in shares for i, counts in s if counts) == list(range(n)), (world, n, shares)
            assert all(0 <= i < n for s in shares for i, _ in s)
            if engine == "fsdp":  # every rank runs ceil(n / world) forwards: FSDP2's forward is a collective
                assert {len(s) for s in shares} == {-(-n // world)}, (world, n, shares)
            else:
                assert all(counts for s in shares for _, counts in s)


class NextIdModel(torch.nn.Module):
    """Eval logits `[1, T, 128]` that predict token id + 1: exact on documents whose ids count up by one."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, batch):
        self.calls += 1
        return 4.0 * torch.nn.functional.one_hot((batch["input_ids"] + 1) % 128, 128).float()


@pytest.mark.parametrize("engine", ["ddp", "fsdp"])
def test_eval_rank_sums_add_up_to_one_process(monkeypatch, engine):
    """Each rank's eval sums (loss, tokens, exact matches, examples), added up, are the 1-process sums; a rank
    short of a pack under FSDP2 runs a forward that counts nothing. Ranks are simulated in this process: the
    all-reduce is replaced by recording each rank's own sums (the real one runs in the 2-process test above).
    Two documents in three count up by one (exact), the third counts by two (wrong): every sum is non-zero."""
    import contextlib

    from hybridtune.data.packing import Example
    from hybridtune.train.evaluation import eval_batches, evaluate

    lengths = [30, 30, 40, 20, 50, 10, 60, 33, 17]  # 5 packs of <= 64 tokens
    examples = [
        Example(
            list(range(3 + i, 3 + i + (2 if i % 3 == 0 else 1) * n, 2 if i % 3 == 0 else 1)),
            [0] * (n // 2) + [1] * (n - n // 2),
        )
        for i, n in enumerate(lengths)
    ]
    assert len(list(eval_batches(examples, 64))) == 5
    model, sums = NextIdModel(), []
    monkeypatch.setattr(distributed, "all_sum", lambda values, d: sums.append(values) or values)

    def run(d):
        model.calls = 0
        res = evaluate(model, examples, 64, torch.device("cpu"), contextlib.nullcontext, d)
        return sums.pop(), model.calls, res

    (want, calls, res), *ranks = [
        run(d) for d in (distributed.ONE, *(distributed.Dist(r, 2, engine=engine) for r in (0, 1)))
    ]
    assert calls == 5 and want[2:] == [6, 9] and res["exact_match"] == pytest.approx(6 / 9)
    assert [c for _, c, _ in ranks] == ([3, 3] if engine == "fsdp" else [3, 2])
    got = [sum(col) for col in zip(*(s for s, _, _ in ranks))]
    assert got[0] == pytest.approx(want[0], rel=1e-12)  # the same per-pack float sums, added in another order
    assert got[1:] == want[1:]  # tokens, exact matches, examples
    assert all(0 < s[3] < want[3] for s, _, _ in ranks)  # each rank evaluated a part, not the whole


@pytest.mark.slow
@pytest.mark.torchrun
def test_all_max_and_all_sum_over_two_processes(ranks):
    """`mem_gib` is logged as the max over ranks: the one all-reduce it takes, over real gloo ranks."""
    got = [r["collectives"] for r in ranks]
    assert got == [{"max": 1.25, "sum": [3.0, 1.0]}] * 2, got


def _strategy(model, engine: str, device: str, share: float | None = None, **cfg) -> tuple[str, str | None, list]:
    """compile and fsdp_units as `choices.resolve` picks them for 2 processes of `engine` on `device`."""
    from hybridtune.config import load_config
    from hybridtune.runtime import choices

    c = load_config(None, cfg)
    facts = choices.Facts(device=device, bf16_supported=True, engine=engine, world=2, whole_model_share=share)
    comp = choices.choose_compile(c, facts)
    return comp.value, choices.choose_fsdp_units(c, facts, comp.value).value, list(comp.warnings)


def test_fsdp_units_and_compile_strategy_choose_each_other():
    """The loop cannot hold per-layer FSDP2 hooks: `layer` units with compile auto compile per class on a GPU,
    and `layer` with an explicit loop is refused at config time; auto units follow the strategy."""
    lin = torch.nn.Linear(2, 2)  # a model without a router loss
    assert _strategy(lin, "fsdp", "cuda", fsdp_units="layer")[:2] == ("modules", "layer")
    assert _strategy(lin, "fsdp", "cuda")[:2] == ("loop", "model")
    assert _strategy(lin, "fsdp", "cuda", fsdp_units="model")[:2] == ("loop", "model")
    assert _strategy(lin, "fsdp", "cuda", compile="modules")[:2] == ("modules", "layer")
    assert _strategy(lin, "fsdp", "cuda", compile="off", fsdp_units="model")[:2] == ("off", "model")
    assert _strategy(lin, "ddp", "cuda", fsdp_units="layer")[:2] == ("loop", None)  # fsdp_units means nothing to DDP
    assert _strategy(lin, "fsdp", "cpu", fsdp_units="layer")[:2] == ("off", "layer")
    with pytest.raises(ConfigError, match="'fsdp_units' = 'layer' and 'compile' = 'loop' do not go together"):
        _strategy(lin, "fsdp", "cuda", fsdp_units="layer", compile="loop")
    assert _strategy(lin, "ddp", "cuda", fsdp_units="layer", compile="loop")[0] == "loop"  # nothing to refuse
    # group:K units (K consecutive layers) carry FSDP2 hooks inside the decoder loop, as layer units do
    assert _strategy(lin, "fsdp", "cuda", fsdp_units="group:4")[:2] == ("modules", "group:4")
    with pytest.raises(ConfigError, match="'fsdp_units' = 'group:2' and 'compile' = 'loop' do not go together"):
        _strategy(lin, "fsdp", "cuda", fsdp_units="group:2", compile="loop")


@pytest.mark.parametrize("bad", ["group:0", "group:", "groups:2", "layers", "group:-1", "group:2x"])
def test_fsdp_units_takes_auto_layer_model_or_group_k(bad):
    assert load_config(None, {"fsdp_units": "group:12"}).fsdp_units == "group:12"
    with pytest.raises(ConfigError, match=r"fsdp_units.*must be auto, layer, model or group:K"):
        load_config(None, {"fsdp_units": bad})


def test_an_error_inside_a_window_puts_fsdp2_back_to_reducing():
    """`accumulation` for a whole-model FSDP2 unit turns gradient sync and resharding off for the window's earlier
    micro-batches; an exception there turns them back on, so nothing after it runs with the model left gathered."""

    class Unit:  # records what FSDP2's setters were told
        sync = reshard = True

        def set_requires_gradient_sync(self, on, recurse):
            self.sync = on

        def set_reshard_after_backward(self, on, recurse):
            self.reshard = on

    d = distributed.Dist(rank=0, world=2, engine="fsdp", units="model")
    unit = Unit()
    with engines.accumulation(unit, d, last=False):
        assert (unit.sync, unit.reshard) == (False, False)
    assert (unit.sync, unit.reshard) == (False, False)  # a window goes on: the last micro-batch turns them on
    with engines.accumulation(unit, d, last=True):
        assert (unit.sync, unit.reshard) == (True, True)
    with pytest.raises(RuntimeError, match="boom"):
        with engines.accumulation(unit, d, last=False):
            raise RuntimeError("boom")
    assert (unit.sync, unit.reshard) == (True, True)
    layer = Unit()
    with engines.accumulation(layer, distributed.Dist(rank=0, world=2, engine="fsdp", units="layer"), last=False):
        assert (layer.sync, layer.reshard) == (True, True)  # per layer: every micro-batch reduces


def test_fsdp_units_auto_shards_per_layer_when_the_whole_model_would_not_fit(monkeypatch):
    """On a GPU, `fsdp_units: auto` keeps the whole model as one unit (and the loop) only when its estimated bytes
    (`whole_model_bytes`) leave room for activations; otherwise per layer, compiled per class, with the reason."""
    import types

    from hybridtune.models.loading import load_model
    from hybridtune.runtime import choices

    model = load_model("tiny-qwen3_5").model  # fp32, all trainable, lm_head tied to the embeddings
    n = sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # counted once
    assert n < sum(p.numel() for _, p in model.named_parameters(remove_duplicate=False))
    # fp32 shards of parameter, gradient and 2 moments; gathered: bf16 copy, fp32 window gradient, bf16 gradient
    assert engines.whole_model_bytes(model, 2) == n * 16 // 2 + n * (2 + 4 + 2)
    assert engines.whole_model_bytes(model, 2, bf16=False) == n * 16 // 2 + n * (4 + 4 + 4)
    # LoRA-like: a frozen bf16 base (its shard and its gathered copy) and fp32 adapters (as a full fine-tune)
    lora = torch.nn.ModuleDict({"base": torch.nn.Linear(10, 10).to(torch.bfloat16), "a": torch.nn.Linear(10, 2)})
    lora["base"].requires_grad_(False)
    assert engines.whole_model_bytes(lora, 2) == (110 * 2 + 22 * 16) // 2 + 110 * 2 + 22 * (2 + 4 + 2)

    # The trainer measures the share against the GPU (max over ranks) ...
    need = engines.whole_model_bytes(model, 2)
    monkeypatch.setattr(distributed, "all_max", lambda value, d: value)  # no process group here: this rank decides
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=4 * need))
    fsdp = distributed.Dist(rank=0, world=2, engine="fsdp")
    assert engines.whole_model_share(model, fsdp, torch.device("cuda", 0), True) == pytest.approx(0.25)
    assert engines.whole_model_share(model, fsdp, torch.device("cpu"), True) is None
    assert engines.whole_model_share(model, distributed.Dist(0, 2), torch.device("cuda", 0), True) is None
    # ... and the choice reads it
    roomy, tight = choices.WHOLE_MODEL_SHARE - 0.01, choices.WHOLE_MODEL_SHARE + 0.01
    assert _strategy(model, "fsdp", "cuda", roomy)[:2] == ("loop", "model")
    assert _strategy(model, "fsdp", "cuda", tight)[:2] == ("modules", "layer")
    c = choices.resolve(load_config_(), choices.Facts("cuda", True, "fsdp", 2, whole_model_share=tight))
    assert "auto -> layer" in c.compile.reason and "auto -> layer" in c.fsdp_units.reason  # the log says why
    assert _strategy(model, "fsdp", "cuda", tight, fsdp_units="model")[:2] == ("loop", "model")  # the user's choice
    value, units, warns = _strategy(model, "fsdp", "cuda", tight, compile="loop")  # ... and an explicit loop's
    assert (value, units) == ("loop", "model") and any("compile: loop keeps it one unit" in w for w in warns)


def load_config_(**over):
    from hybridtune.config import load_config

    return load_config(None, over)
