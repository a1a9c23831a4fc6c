"""`kill -USR1` on a running hybridtune command prints every thread's Python stack (how a stalled run says where)."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest


@pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="no SIGUSR1 on this platform")
def test_sigusr1_prints_python_stacks_and_the_process_goes_on():
    code = (
        "import os, signal\n"
        "from hybridtune.cli import _stack_dumps_on_sigusr1\n"
        "_stack_dumps_on_sigusr1()\n"
        "def waiting_here():\n"
        "    os.kill(os.getpid(), signal.SIGUSR1)\n"
        "waiting_here()\n"
        "print('still running')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "still running" in r.stdout
    assert "most recent call first" in r.stderr and "waiting_here" in r.stderr, r.stderr
