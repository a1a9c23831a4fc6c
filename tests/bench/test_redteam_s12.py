"""Red-team checks (session 12) of a stopped `hybridtune bench` (d74cd39): what a signal at each point leaves.

Each test fails on d74cd39; the fix each one asks for is named in its docstring."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
from test_bench_stop import _alive, _stand_in_bench, _wait_pid  # the stop tests' process probes

from hybridtune.bench import command, report
from hybridtune.cli import main

ARGV = ["bench", "--steps", "1", "--warmup", "1", "--layouts", "1"]


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return not _alive(pid)


def _result() -> dict:
    """A finished mode's result, as the worker writes it (the keys the table and the rows read)."""
    return {
        "tokens_per_s": 1234.0,
        "median_step_s": 0.2,
        "first_step_s": 1.5,
        "peak_rss_gib": 0.1,
        "loss_step1": 12.0,
        "loss_last10_mean": 11.5,
        "losses": [12.0, 11.5],
        "graph_breaks": 0,
        "recompiles_after_warmup": 0,
    }


def _fake_worker(calls: list, interrupt_at: str | None = None):
    def worker(spec, log, startup, timeout):
        what = spec.get("mode", spec["kind"])
        calls.append(what)
        if what == interrupt_at:
            raise KeyboardInterrupt  # what sigterm_interrupts raises on SIGTERM
        return {"flops_per_s": 1e12} if what == "peak" else _result()

    return worker


def test_a_signal_after_a_mode_finished_keeps_its_result(tmp_path, monkeypatch):
    """The signal arrives once ht-eager's worker has returned its result, while bench.json is rewritten (an fsync:
    the widest such window; the log line after the result and the gap before the next mode's `label = ...` are
    others). `_run_modes`' except branch still holds `label == "ht-eager"` and overwrites the finished mode's
    result with STOPPED_BY_SIGNAL: a measured mode is reported, in bench.json, bench.md and the results row, as
    stopped. Fix (command.py, `_run_modes`): clear `label` (label = None) right after
    `doc["modes"][label] = run_worker(...)`, before the log line and `_write_json`, so only the mode whose worker
    was in flight is marked stopped."""
    calls: list = []
    monkeypatch.setattr(command, "run_worker", _fake_worker(calls))
    real_write = command._write_json
    writes = []

    def write(path, doc):
        writes.append(path)
        if len(writes) == 1:
            raise KeyboardInterrupt  # SIGTERM during the fsync of bench.json after the first mode
        real_write(path, doc)

    monkeypatch.setattr(command, "_write_json", write)
    out, table = tmp_path / "bench", tmp_path / "results.jsonl"
    rc = main([*ARGV, "--modes", "ht-eager,hf-eager", "--output_dir", str(out), "--results", str(table)])
    assert rc == 130 and calls == ["peak", "ht-eager"]
    doc = json.loads((out / "bench.json").read_text())
    assert doc["modes"]["ht-eager"].get("tokens_per_s") == 1234.0, doc["modes"]["ht-eager"]
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    assert [(r["mode"], r["status"]) for r in rows] == [("ht-eager", "ok")]


def test_a_signal_while_the_results_are_written_keeps_the_rows(tmp_path, monkeypatch):
    """Every mode finished; the Ctrl-C arrives while bench.png is drawn (matplotlib's import and render: the
    slowest part of the writing stage, a second or more). `main` writes bench.json and bench.md, then the chart,
    then the rows, all outside `_run_modes`' handler: the KeyboardInterrupt escapes to the CLI ("interrupted",
    130) and no row of the finished modes is ever appended. (A SIGTERM there is worse: sigterm_interrupts has been
    left, so it kills the bench outright: see the next test.) Fix (command.py, `main`): append the rows before
    the chart (the chart is optional), and run the whole writing stage (bench.json, bench.md, rows, chart) with
    SIGINT/SIGTERM deferred (e.g. keep `sigterm_interrupts` / a handler that records the signal around it and
    return 130 afterwards), so a stop there still leaves every record."""
    calls: list = []
    monkeypatch.setattr(command, "run_worker", _fake_worker(calls))

    def chart(doc, path, title=None):
        raise KeyboardInterrupt  # Ctrl-C while bench.png is drawn

    monkeypatch.setattr(report, "chart", chart)
    out, table = tmp_path / "bench", tmp_path / "results.jsonl"
    main([*ARGV, "--modes", "ht-eager,hf-eager", "--output_dir", str(out), "--results", str(table)])
    assert table.is_file(), "the finished modes' rows were never appended"
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    assert [(r["mode"], r["status"]) for r in rows] == [("ht-eager", "ok"), ("hf-eager", "ok")]


def _bench_script(tmp_path, body: str) -> str:
    return textwrap.dedent(
        f"""
        import os, signal, sys, time
        from hybridtune.bench import command, report
        from hybridtune.cli import main
        OUT, TABLE = {str(tmp_path / "bench")!r}, {str(tmp_path / "results.jsonl")!r}
        """
    ) + textwrap.dedent(body)


def test_a_sigterm_while_the_results_are_written_keeps_the_rows(tmp_path):
    """As above with `timeout`'s SIGTERM: it arrives after `_run_modes` left `sigterm_interrupts`, so SIGTERM's
    default action kills the bench (exit -15, not 130) with bench.png, the printed table and every row missing.
    Same fix as above: the writing stage under the stop handling, rows first."""
    script = _bench_script(
        tmp_path,
        """
        def worker(spec, log, startup, timeout):
            if spec["kind"] == "peak":
                return {"flops_per_s": 1e12}
            return {"tokens_per_s": 1234.0, "median_step_s": 0.2, "first_step_s": 1.5, "peak_rss_gib": 0.1,
                    "loss_step1": 12.0, "loss_last10_mean": 11.5, "losses": [12.0, 11.5], "graph_breaks": 0,
                    "recompiles_after_warmup": 0}
        def chart(doc, path, title=None):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
        command.run_worker, report.chart = worker, chart
        sys.exit(main(["bench", "--steps", "1", "--warmup", "1", "--layouts", "1", "--modes", "ht-eager",
                       "--output_dir", OUT, "--results", TABLE]))
        """,
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    table = tmp_path / "results.jsonl"
    assert proc.returncode == 130, (proc.returncode, proc.stderr[-2000:])
    rows = [json.loads(line) for line in table.read_text().splitlines()] if table.is_file() else []
    assert [(r["mode"], r["status"]) for r in rows] == [("ht-eager", "ok")]


def test_a_hangup_stops_the_worker(tmp_path):
    """The worker runs in a session of its own, so the terminal's SIGHUP (an ssh connection dropped, a tmux or
    screen window closed, `kill -HUP`) reaches the bench alone; the bench handles SIGINT and SIGTERM only, dies of
    the SIGHUP at once, and leaves the worker running: the very orphan d74cd39 set out to prevent (78 GB held on
    the H200). Fix (command.py, `_run_modes`, or runtime/signals.py with a variant of `sigterm_interrupts`): raise
    KeyboardInterrupt on SIGHUP too (and SIGQUIT) for the duration of the modes, so the worker in flight is
    killed and the finished modes kept. For a bench killed outright (SIGKILL: the OOM killer, a scheduler's
    grace period over) the worker should also watch its parent: `preexec_fn` / the worker's start calling
    prctl(PR_SET_PDEATHSIG, SIGTERM), or a thread in the worker that exits when os.getppid() changes."""
    pidfile = tmp_path / "worker.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    script = _bench_script(
        tmp_path,
        f"""
        real = command.run_worker
        def worker(spec, log, startup, timeout):
            return real(spec, log, startup, timeout, program=[sys.executable, "-c", {child!r}])
        command.run_worker = worker
        sys.exit(main(["bench", "--steps", "1", "--warmup", "1", "--layouts", "1", "--modes", "ht-eager",
                       "--output_dir", OUT]))
        """,
    )
    bench = subprocess.Popen([sys.executable, "-c", script])
    pid = None
    try:
        pid = _wait_pid(pidfile)
        assert _alive(pid)
        bench.send_signal(signal.SIGHUP)
        bench.wait(timeout=60)
        assert _gone_within(pid, 10), f"the worker outlived its bench (bench exit {bench.returncode})"
    finally:
        bench.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_signal_as_the_worker_starts_stops_it(tmp_path, monkeypatch):
    """`run_worker` starts the worker (Popen), defines the pump and starts the reader thread before it enters the
    try whose finally kills the worker: a KeyboardInterrupt (Ctrl-C, or SIGTERM under sigterm_interrupts) in that
    gap leaves the worker running in its own session, an orphan. Simulated by the reader thread's start raising.
    Fix (command.py, `run_worker`): open the try/finally right after Popen returns (the reader's start inside it),
    and start the worker with SIGINT/SIGTERM blocked in the parent (signal.pthread_sigmask around Popen, the
    child's mask restored in preexec_fn or by the worker) so no signal can fall between the fork and the try."""
    pidfile = tmp_path / "worker.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"

    class Thread:
        def __init__(self, *a, **kw):
            pass

        def start(self):
            _wait_pid(pidfile)  # the worker is up (and would stay up)
            raise KeyboardInterrupt

    import threading

    monkeypatch.setattr(command, "threading", types.SimpleNamespace(Event=threading.Event, Thread=Thread))
    pid = None
    try:
        with pytest.raises(KeyboardInterrupt):
            command.run_worker({}, tmp_path / "w.log", 600, 600, program=[sys.executable, "-c", child])
        pid = _wait_pid(pidfile)
        assert _gone_within(pid, 10), "the worker outlived the interrupted run_worker"
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_second_signal_while_the_worker_is_stopped_still_kills_it(tmp_path):
    """A worker that does not die of SIGTERM at once is SIGKILLed by `_kill` after 20 s, but a second Ctrl-C or
    SIGTERM in those 20 s raises KeyboardInterrupt out of `proc.wait(timeout=20)`: the SIGKILL is never sent and
    the bench exits with the worker alive. (The same second signal just before `os.killpg(..., SIGTERM)` leaves
    it unsignalled.) Fix (command.py, `_kill` / `run_worker`'s finally): make the stop uninterruptible: block
    SIGINT/SIGTERM (signal.pthread_sigmask) while killing, or catch KeyboardInterrupt in `_kill`, send SIGKILL to
    the group at once, wait, and re-raise."""
    pidfile = tmp_path / "worker.pid"
    child = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    )
    bench = subprocess.Popen([sys.executable, "-c", _stand_in_bench(child, tmp_path / "bench.log")])
    pid = None
    try:
        pid = _wait_pid(pidfile)
        bench.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        bench.send_signal(signal.SIGTERM)  # impatient: the second stop request
        bench.wait(timeout=60)
        assert _gone_within(pid, 10), "the worker outlived its bench"
    finally:
        bench.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_grouped_gemm_counts_gemm_kernels_not_the_pointwise_kernels_fused_around_them():
    """`profiling.grouped_gemm` (f25ec81) matches "grouped" anywhere in a kernel's name, but inductor names every
    generated kernel after the aten ops it came from: the layout copy / cast / scale it emits around
    `aten._grouped_mm` in the experts' backward is named `triton_poi_fused__grouped_mm_expand_mul_transpose_0`
    on CUDA (`cpp_fused__grouped_mm_expand_mul_transpose_0` from the same graph on the CPU: seen here with
    torch.compile of `F.grouped_mm(x * 2, w.transpose(1, 2), offs)` backward). Its time is then summed into
    grouped_gemm_ms_per_step, so expert_gemms' kernel_ms_per_step is too large and its TFLOP/s too small.
    Fix (runtime/profiling.py, `grouped_gemm`): leave out inductor's pointwise / reduction kernels
    (names starting "triton_poi_", "triton_red_", "triton_per_", "cpp_fused"): among inductor's kernels only its
    templates ("triton_tem_...grouped_mm...") are GEMMs."""
    from hybridtune.runtime.profiling import grouped_gemm

    assert grouped_gemm("triton_tem_fused__grouped_mm_0")  # inductor's grouped-GEMM template: a GEMM
    assert grouped_gemm("_ZN7cutlass13device_kernelIN2at4cuda6detail...GroupProblemShapeIN4cute5tupleIJiiiEEEE")
    assert not grouped_gemm("triton_poi_fused__grouped_mm_expand_mul_transpose_0")  # a copy/scale, not a GEMM
    assert not grouped_gemm("triton_red_fused__grouped_mm_sum_1")
