"""The trainer acts on `cuda_graphs` and on `gradient_checkpointing: auto`'s estimate (CPU: the GPU-only parts are
stood in for, the wiring is real).

- CUDA graphs on: the loop compiles with mode "reduce-overhead" over the static layout, FLA's tensor cache is
  switched off and the GDN conv is FLA's op inside the graph while the run lasts (put back after), every forward
  (each micro-batch, each eval pack) starts a CUDA-graph step, the losses are those of the run without, and the
  log says what was chosen and how many graphs were recorded.
- The compile caches are placed before the kernels and the compile, and the log says cold or warm.
- `gradient_checkpointing: auto` decided on from the estimate: checkpointing is on before the compile sees the
  model, and the first step is not the out-of-memory retry.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from hybridtune.mixers.gdn import fla_adapter
from hybridtune.mixers.gdn.ops import conv_in_graph
from hybridtune.runtime import choices, compose, oom
from hybridtune.train import setup as trainer_setup
from hybridtune.train.evaluation import eval_batches
from hybridtune.train.trainer import Trainer
from train_runs import make_cfg, run_static


def _checkpointed(model) -> bool:
    return any(getattr(m, "gradient_checkpointing", False) for m in model.modules())


@pytest.fixture
def fake_compile(monkeypatch):
    """compile_model replaced by a recorder (the model runs eagerly): what it was asked, and the state then."""
    calls = []

    def record(model, strategy, **opts):
        calls.append(
            {"strategy": strategy, "opts": opts, "conv": conv_in_graph(), "checkpointed": _checkpointed(model)}
        )

    monkeypatch.setattr(compose, "compile_model", record)
    return calls


@pytest.fixture
def warn_limit():
    """inductor's per-size CUDA-graph warning limit, set low for the test and put back after (its config's own
    patch: monkeypatch's undo would delete the key)."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"triton.cudagraph_dynamic_shape_warn_limit": 1}):
        yield inductor_config.triton


@pytest.fixture
def caches(tmp_path, monkeypatch):
    monkeypatch.setenv("HYBRIDTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    return tmp_path / "cache"


def _run(out, data, **kw):
    return run_static(out, data, max_steps=4, compile="loop", **kw)


def test_cuda_graphs_wiring(tmp_path, small_data, monkeypatch, fake_compile, caches, caplog, warn_limit):
    plain_t, plain = _run(tmp_path / "plain", small_data)
    assert plain_t.choices.cuda_graphs.value is False and "CUDA graphs need a GPU" in plain_t.choices.cuda_graphs.reason
    assert fake_compile[-1]["opts"] == {
        "static_shapes": True,
        "regional": True,
        "keep_cores": False,
    }  # regions auto; no checkpointing on the CPU
    assert fake_compile[-1]["conv"] == "traced"

    real = choices.choose_cuda_graphs  # the real decision, as on a GPU
    monkeypatch.setattr(
        choices, "choose_cuda_graphs", lambda cfg, f, s, lay: real(cfg, dataclasses.replace(f, device="cuda"), s, lay)
    )
    marks, fla = [], []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    monkeypatch.setattr(fla_adapter, "disable_tensor_cache", lambda: fla.append(1) or True)
    with caplog.at_level(logging.INFO, logger="hybridtune"):
        t, got = _run(tmp_path / "cg", small_data)
    keys = len(choices.cuda_graph_keys(t.collate.layout, t.facts.packs))
    assert t.cuda_graphs and fake_compile[-1]["opts"] == {
        "static_shapes": True,
        "regional": True,
        "keep_cores": False,
        "mode": "reduce-overhead",
    }
    assert fake_compile[-1]["conv"] == "op" and conv_in_graph() == "traced"  # op while it ran, put back after
    assert fla == [1] and warn_limit.cudagraph_dynamic_shape_warn_limit == keys
    # One step mark per forward: 4 steps x 2 micro-batches, and every eval pack of every eval.
    packs = len(list(eval_batches(t._eval_examples(), t.cfg.sequence_len)))
    assert len(got.evals) >= 2 and len(marks) == 4 * 2 + len(got.evals) * packs
    assert len(got.losses) == 4 and got.losses == pytest.approx(plain.losses, rel=1e-6, abs=0)
    for a, b in zip(got.evals, plain.evals):
        assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-6)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "choice cuda_graphs: True (auto: the compiled loop over the static layout in one process" in text
    assert f"cuda graphs: an unknown number of recorded (at most {keys} per compiled graph" in text
    assert f"compile caches: inductor {caches / 'inductor'} (cold, empty); triton {caches / 'triton'}" in text


def test_compile_regions_reaches_the_loop(tmp_path, small_data, fake_compile):
    """`compile_regions` reaches compile_loop(regional=...): on under auto (one process) and true, off under false."""
    for value, want in (("auto", True), (True, True), (False, False)):
        t, _ = _run(tmp_path / f"reg-{value}", small_data, compile_regions=value)
        assert fake_compile[-1]["strategy"] == "loop" and fake_compile[-1]["opts"]["regional"] is want
        assert t.choices.compile_regions.value is want


def test_compile_regions_without_the_loop_says_it_does_nothing(tmp_path, small_data, fake_compile, caplog):
    cfg = make_cfg(tmp_path / "off", small_data, max_steps=1, compile="off", compile_regions=True)
    t = Trainer(cfg)
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        t.setup()
    t.close()
    assert "compile_regions: no effect under compile strategy 'off'" in caplog.text and not fake_compile


def test_checkpointing_auto_from_the_estimate_is_on_before_the_compile(tmp_path, small_data, monkeypatch, fake_compile):
    real = trainer_setup.measure

    def gpu_facts(cfg, device, d, model=None, bf16=False, packs=()):
        facts = real(cfg, device, d, model, bf16, packs)
        # A GPU with 1 MiB free: no step fits without checkpointing.
        return facts if model is None else dataclasses.replace(facts, device="cuda", gpu_free_bytes=2**20)

    monkeypatch.setattr(trainer_setup, "measure", gpu_facts)  # (the trainer's setup measures)
    monkeypatch.setattr(oom, "retry_with_checkpointing", lambda *a: pytest.fail("the first step was the OOM retry"))
    cfg = make_cfg(tmp_path / "a", small_data, max_steps=2, compile="modules", gradient_checkpointing="auto")
    t = Trainer(cfg)
    t.setup()
    assert t.choices.checkpointing.value is True and t.choices.checkpointing.reason.startswith("auto: on: ")
    assert fake_compile[-1]["checkpointed"] and _checkpointed(t.model)
    assert t.choices.cuda_graphs.value is False and "compile modules" in t.choices.cuda_graphs.reason
    assert t.train().steps == 2


def test_cuda_graphs_on_where_it_cannot_run_is_one_line_and_exit_2(tmp_path, small_data, capsys):
    from hybridtune.cli import main

    out = tmp_path / "run"
    argv = ["train", "--dataset", small_data, "--max_steps", "1", "--output_dir", str(out), "--cuda_graphs", "on"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("cuda_graphs 'on': CUDA graphs need a GPU; use cuda_graphs: auto (or off)"), err[-1]
    assert "Traceback" not in "\n".join(err)
    assert not out.exists() or not any(out.iterdir())  # refused before anything was written


def test_graph_log_says_the_count_when_it_changes_and_at_the_end(monkeypatch):
    from hybridtune.runtime import cudagraphs

    counts = iter([None, 0, 0, 2, 2, 6, 6])
    monkeypatch.setattr(cudagraphs, "recorded", lambda device: next(counts))
    log = cudagraphs.GraphLog(torch.device("cpu"), keys=3)
    lines = [log.changed() for _ in range(6)]
    assert [x is not None for x in lines] == [True, True, False, True, False, True]
    assert lines[0].startswith("cuda graphs: an unknown number of recorded (at most 3 per compiled graph")
    assert lines[5].startswith("cuda graphs: 6 recorded (at most 3 per compiled graph, one per distinct GDN chunk")
    assert log.final().startswith("cuda graphs: 6 recorded")


def test_a_setup_that_fails_after_prepare_puts_the_conv_form_back(tmp_path, small_data, monkeypatch, warn_limit):
    real = choices.choose_cuda_graphs
    monkeypatch.setattr(
        choices, "choose_cuda_graphs", lambda cfg, f, s, lay: real(cfg, dataclasses.replace(f, device="cuda"), s, lay)
    )

    def broken(model, strategy, **opts):
        assert conv_in_graph() == "op"
        raise RuntimeError("compile failed")

    monkeypatch.setattr(compose, "compile_model", broken)
    t = Trainer(make_cfg(tmp_path / "a", small_data, max_steps=1, compile="loop", pack_layout="static"))
    with pytest.raises(RuntimeError, match="compile failed"):
        t.setup()
    assert conv_in_graph() == "traced"
