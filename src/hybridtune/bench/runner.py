"""One benchmark mode's worker process, run and stopped: `python -m hybridtune.bench.worker` in a session of its own,
its output copied to the mode's log, stopped at `--startup_timeout` without a first step or at the mode's time
limit, and on an interrupt of the bench (SIGTERM to its group, SIGKILL after a grace period): an orphan would hold
the GPU's memory."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from hybridtune.bench.worker import FIRST_STEP_MARKER
from hybridtune.runtime.signals import deferring

STOP_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT")


def run_worker(
    spec: dict, log_path: Path, startup_timeout: float, timeout: float, program: list[str] | None = None
) -> dict:
    """Run one worker process; stop it at the time limits; return its result dict. The worker runs in a session of
    its own (a stop kills its compile workers with it), so it is also stopped when this process is interrupted
    (Ctrl-C, or a signal that `interrupting` turns into one): an orphan would hold the GPU's memory. `program` replaces
    `python -m hybridtune.bench.worker` (tests)."""
    with tempfile.TemporaryDirectory(prefix="hybridtune-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = [*(program or [sys.executable, "-m", "hybridtune.bench.worker"]), str(spec_path), str(out_path)]
        started = threading.Event()
        t0 = time.monotonic()
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
            )
            stopped = None
            try:  # from here on an interrupt stops the worker

                def pump() -> None:
                    for line in proc.stdout:
                        log.write(line)
                        log.flush()
                        if line.startswith(FIRST_STEP_MARKER):
                            started.set()

                reader = threading.Thread(target=pump, daemon=True)
                reader.start()
                while proc.poll() is None:
                    elapsed = time.monotonic() - t0
                    if not started.is_set() and elapsed > startup_timeout:
                        stopped = f"no first step within {startup_timeout:.0f} s"
                    elif elapsed > timeout:
                        stopped = f"not finished within {timeout:.0f} s"
                    if stopped:
                        break
                    time.sleep(0.5)
            finally:
                if proc.poll() is None:
                    _kill(proc)
            proc.wait()
            reader.join(timeout=10)
        wall = time.monotonic() - t0
        if stopped:
            return {"error": stopped, "stopped": True, "wall_s": wall}
        if not out_path.is_file():
            return {
                "error": f"worker exited with code {proc.returncode} and no result (see {log_path})",
                "wall_s": wall,
            }
        result = json.loads(out_path.read_text())
        result["wall_s"] = wall
        return result


KILL_GRACE_S = 20.0  # a stopped worker's time to exit on SIGTERM before SIGKILL


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM to the worker's process group, SIGKILL after KILL_GRACE_S or at once on a second stop request; the
    request cannot cut the stop short (it would leave the worker running) and is raised after it."""
    import signal

    with deferring("SIGINT", *STOP_SIGNALS, why="stopping the worker at once") as again:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + KILL_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline and not again.received:
            time.sleep(0.1)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if again.received:
        raise KeyboardInterrupt
