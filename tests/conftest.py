"""Shared test setup: `cuda` tests skip cleanly without a GPU; `slow` tests wait for their tier; tests never reach
a hub.

Two tiers. `python -m pytest -q -n auto` (the README's test command: pytest-xdist, a worker per core) runs the fast
tier: every module, in a few minutes on 2 cores. Tests marked `slow` (two-process torchrun runs, CPU compiles of
whole models, the CLI in a fresh interpreter, the bench smoke) are skipped there, saying how to run them; `.ci/run`
runs them as a second command, `python -m pytest -q -m slow`. Any `-m` expression chooses the tests itself
(`-m slow`, `-m cuda`, `-m "not cuda"`), and `--run-slow` adds the slow tier to whatever else is selected.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# No test may download anything: models and tokenizers come from presets and the bundled files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# The datasets cache (and the tokenised data cached in it) of a test session is its own, removed at its end: tests
# never read a cache an earlier session or the user left, nor leave one in the home directory.
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="hybridtune-test-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)
# Keep thread counts small and deterministic on the 2-core CI machine.
os.environ.setdefault("OMP_NUM_THREADS", "1")  # tiny tensors: threads cost more than they save


@pytest.fixture(autouse=True)
def _hybridtune_logger_restored():
    """`hybridtune.cli.main` called in a test sets up the `hybridtune` logger on that test's captured stderr: put
    the logger back afterwards, so later tests never log into a closed capture."""
    import logging

    log = logging.getLogger("hybridtune")
    saved = (log.handlers[:], log.level, log.propagate)
    yield
    log.handlers[:], log.level, log.propagate = saved[0], saved[1], saved[2]


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow", action="store_true", default=False, help="run the tests marked slow too (CI runs them)"
    )


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks set here
def pytest_collection_modifyitems(config, items):
    # Under pytest-xdist (`-n 2 --dist loadgroup`, as .ci/run runs the slow tier) the torchrun tests share one
    # worker, so at most one 2-process run holds ports and cores at a time; the rest spread over the workers.
    for item in items:
        if "torchrun" in item.keywords:
            item.add_marker(pytest.mark.xdist_group("torchrun"))
    if getattr(config.option, "loadgroup", False):  # an xdist worker under --dist loadgroup
        _group_in_node_ids(items)
    if not (config.getoption("--run-slow") or config.getoption("markexpr")):
        skip_slow = pytest.mark.skip(reason="slow tier: run with `-m slow` or --run-slow (.ci/run does)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def _group_in_node_ids(items) -> None:
    """pytest-xdist (3.8) sends a test of an xdist_group to its group's worker by appending `@group` to the test's
    node id, assigned to `item._nodeid`; pytest 9.2 derives node ids from a structured `item._id` instead, so that
    assignment changes nothing and --dist loadgroup silently groups nothing (pytest-dev/pytest-xdist#1386): here
    the suffix goes into `_id`. Older pytest (no `_pytest.nodeid`): xdist's own suffix works. An xdist that does it
    itself appends a second `@group`; its scheduler reads the last one, the same group."""
    try:
        from _pytest.nodeid import NodeId
    except ImportError:
        return
    for item in items:
        names = {
            str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in item.iter_markers("xdist_group")
        }
        if names and isinstance(getattr(item, "_id", None), NodeId):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(sorted(names))}")


@pytest.fixture(scope="session", autouse=True)
def _shipped_kernel_configs():
    """On a GPU: FLA's autotuners seeded from the shipped table of this GPU kind before the first kernel runs, as a
    run's self-test does (mixers/gdn/tuned.py), so the CUDA tier does not autotune what the table covers. With
    HYBRIDTUNE_SAVE_KERNEL_CONFIGS=PATH, what the session chose is added to PATH at its end (one file per xdist
    worker: PATH.<worker>), to grow the table."""
    try:
        import torch
    except ImportError:
        yield
        return
    if not torch.cuda.is_available():
        yield
        return
    from hybridtune.mixers.gdn import tuned
    from hybridtune.mixers.registry import selftests

    device = torch.cuda.get_device_name(torch.cuda.current_device())
    try:
        for suite in selftests():
            suite.prepare()
        print(f"\n{tuned.seed(device)}")
    except ImportError as e:  # no FLA here: the tests that need it skip with their own reason
        print(f"\nkernel configs not seeded: {e}")
    yield
    _save_kernel_configs()


def _save_kernel_configs() -> None:
    """With HYBRIDTUNE_SAVE_KERNEL_CONFIGS=PATH on a GPU: what this process's autotuners chose, added to PATH (one
    file per xdist worker: PATH.<worker>; `python -m hybridtune.mixers.gdn.tuned merge` folds them)."""
    target = os.environ.get("HYBRIDTUNE_SAVE_KERNEL_CONFIGS")
    if not target or "fla" not in sys.modules:
        return
    import torch

    from hybridtune.mixers.gdn import tuned

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    tuned.save(
        Path(f"{target}.{worker}" if worker else target), torch.cuda.get_device_name(torch.cuda.current_device())
    )


@pytest.fixture(autouse=True)
def _kernel_configs_kept_per_test(request):
    """The table saved after every CUDA test too, not only at the session's end: a tier cut by its time limit (a
    GPU call's) still leaves what it tuned."""
    yield
    if "cuda" in request.keywords:
        _save_kernel_configs()


@pytest.fixture(autouse=True)
def _fla_switch_restored():
    """A run with `kernels: off` turns hybridtune's ops off FLA for the process (ops.fla_adapter.turn_off): put the
    switch back after each test, so a later GPU test never runs the reference path unawares."""
    yield
    import sys

    adapter = sys.modules.get("hybridtune.mixers.gdn.fla_adapter")
    if adapter is not None:
        adapter.turn_off(None)


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> str:
    """A small chat dataset (arithmetic) so CLI tests run in seconds; tests only read it."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    rows = []
    for _ in range(120):
        a, b = rng.randrange(50), rng.randrange(50)
        rows.append(
            {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": str(a + b)}]}
        )
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture
def aot_eager(monkeypatch):
    """The trainer's compile_model, real, under the aot_eager backend (inductor's CPU build would cost minutes);
    the handles it made."""
    # Imported here, not at the top: this conftest loads for every test, most of which never build a trainer.
    from hybridtune.compiler import strategies
    from hybridtune.runtime import compose

    handles = []

    def compile_(model, strategy, **opts):
        handles.append(strategies.compile_model(model, strategy, backend="aot_eager", **opts))
        return handles[-1]

    monkeypatch.setattr(compose, "compile_model", compile_)
    return handles
