"""A `hybridtune bench` that is stopped (Ctrl-C, SIGTERM from `timeout` or a scheduler) takes its worker with it
and keeps what it measured: the modes done so far become bench.json entries, table lines and rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from hybridtune.bench import command
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
