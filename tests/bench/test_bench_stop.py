"""A `hybridtune bench` that is stopped (Ctrl-C, SIGTERM from `timeout` or a scheduler) takes its worker with it
and keeps what it measured: the modes done so far become bench.json entries, table lines and rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types

import pytest

from hybridtune.bench import command, report, runner
from hybridtune.cli import main


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped: an orphan's reaper may be slow or absent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_pid(pidfile, seconds: float = 60) -> int:
    """The pid a test's stand-in worker wrote to `pidfile` once it is up."""
    deadline = time.monotonic() + seconds
    while not (pidfile.is_file() and pidfile.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return int(pidfile.read_text())


def _stand_in_bench(child: str, log) -> str:
    """A program that runs `run_worker` with the Python code `child` as its worker, SIGTERM stopping it as it stops
    the bench's modes; it exits 130 when stopped."""
    return textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from hybridtune.bench.command import run_worker
        from hybridtune.runtime.signals import sigterm_interrupts
        with sigterm_interrupts():
            try:
                run_worker({{}}, Path({str(log)!r}), 600, 600, program=[sys.executable, "-c", {child!r}])
            except KeyboardInterrupt:
                sys.exit(130)
        """
    )


def test_a_stopped_bench_stops_its_worker(tmp_path):
    """The worker runs in a session of its own (so a time limit can kill its compile workers with it); a SIGTERM to
    the bench must still reach it, or an orphan goes on holding the GPU (seen on the H200: 78 GB held after the
    bench was killed by `timeout`)."""
    pidfile = tmp_path / "worker.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
    bench = subprocess.Popen([sys.executable, "-c", _stand_in_bench(child, tmp_path / "w.log")])
    pid = None
    try:
        pid = _wait_pid(pidfile)
        assert _alive(pid)
        bench.send_signal(signal.SIGTERM)
        assert bench.wait(timeout=60) == 130
        assert not _alive(pid), "the worker outlived its bench"
    finally:
        bench.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_stopped_bench_keeps_the_modes_it_finished(tmp_path, monkeypatch):
    """The first mode runs for real; the signal arrives while the second runs: exit 130, the first mode's result in
    bench.json, bench.md and the results table, the second marked as stopped, the third never started."""
    real = command.run_worker
    calls = []

    def worker(spec, log, startup, timeout):
        calls.append(spec.get("mode", spec["kind"]))
        if spec.get("mode") == "hf-eager":
            raise KeyboardInterrupt  # what sigterm_interrupts raises on SIGTERM
        return real(spec, log, startup, timeout)

    monkeypatch.setattr(command, "run_worker", worker)
    out, table = tmp_path / "bench", tmp_path / "results.jsonl"
    argv = ["bench", "--modes", "ht-eager,hf-eager,ht-loop", "--steps", "1", "--warmup", "1", "--layouts", "1"]
    rc = main([*argv, "--output_dir", str(out), "--results", str(table)])
    assert rc == 130
    assert calls == ["peak", "ht-eager", "hf-eager"]  # ht-loop never started
    doc = json.loads((out / "bench.json").read_text())
    assert doc["peak"]["flops_per_s"] > 0 and list(doc["modes"]) == ["ht-eager", "hf-eager"]
    assert doc["modes"]["ht-eager"]["tokens_per_s"] > 0
    assert doc["modes"]["hf-eager"] == {"error": command.STOPPED_BY_SIGNAL, "stopped": True}
    assert doc["not_run"] == ["ht-loop"]
    assert "| ht-eager |" in (out / "bench.md").read_text()
    assert "Not run (the bench was stopped before them): ht-loop." in (out / "bench.md").read_text()
    log = (out / "logs" / "ht-eager.log").read_text()  # start-up phases are said as they end (a cut mode's log)
    assert "phase " in log and "model built" in log and log.index("model built") < log.index("HYBRIDTUNE_BENCH_FIRST")
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    assert [(r["mode"], r["status"]) for r in rows] == [("ht-eager", "ok"), ("hf-eager", command.STOPPED_BY_SIGNAL)]
    assert rows[0]["tokens_per_s"] > 0 and rows[1]["tokens_per_s"] is None


def test_a_worker_ends_when_its_bench_is_killed_outright(tmp_path):
    """SIGKILL (the OOM killer, a scheduler's grace period over) gives the bench no chance to stop its worker, which
    runs in a session of its own: the worker watches its parent and ends its process group when it is gone."""
    pidfile = tmp_path / "worker.pid"
    child = textwrap.dedent(
        f"""
        import os, time
        from hybridtune.bench.worker import exit_with_parent
        exit_with_parent(os.getppid(), every=0.1)
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        time.sleep(120)
        """
    )
    parent = textwrap.dedent(
        f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}], start_new_session=True)
        time.sleep(120)
        """
    )
    bench = subprocess.Popen([sys.executable, "-c", parent])
    pid = None
    try:
        pid = _wait_pid(pidfile, 120)
        bench.kill()
        bench.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "the worker outlived its bench's SIGKILL"
    finally:
        bench.kill()
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


# --- a signal at each point of the bench: what it leaves ---------------------------------------------------------

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
    the widest such window). Only the mode whose worker was in flight is marked stopped: the finished mode keeps
    its measurement in bench.json and its results row."""
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
    """Every mode finished; the Ctrl-C arrives while bench.png is drawn (the slowest part of the writing stage).
    The rows of the finished modes are appended all the same (rows before the chart, the writing stage with the
    stop deferred)."""
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
    """As above with `timeout`'s SIGTERM, which arrives after the modes' stop handling was left: the bench still
    exits 130 (not killed by the signal's default action) with every row written."""
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
    """The worker runs in a session of its own, so the terminal's SIGHUP (an ssh connection dropped, a tmux window
    closed, `kill -HUP`) reaches the bench alone: the bench stops its worker on SIGHUP as on SIGINT and SIGTERM,
    leaving no orphan holding the GPU."""
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
    """A KeyboardInterrupt between the worker's start (Popen) and the try whose finally kills it (simulated by the
    reader thread's start raising) still stops the worker: no orphan in its own session."""
    pidfile = tmp_path / "worker.pid"
    child = f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); time.sleep(120)"

    class Thread:
        def __init__(self, *a, **kw):
            pass

        def start(self):
            _wait_pid(pidfile)  # the worker is up (and would stay up)
            raise KeyboardInterrupt

    monkeypatch.setattr(runner, "threading", types.SimpleNamespace(Event=threading.Event, Thread=Thread))
    pid = None
    try:
        with pytest.raises(KeyboardInterrupt):
            runner.run_worker({}, tmp_path / "w.log", 600, 600, program=[sys.executable, "-c", child])
        pid = _wait_pid(pidfile)
        assert _gone_within(pid, 10), "the worker outlived the interrupted run_worker"
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_second_signal_while_the_worker_is_stopped_still_kills_it(tmp_path):
    """A worker that ignores SIGTERM is SIGKILLed after the grace period; a second Ctrl-C or SIGTERM during that
    wait (an impatient user) must not leave it alive."""
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
