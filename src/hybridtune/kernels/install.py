"""The pip installer behind `kernels: auto`: wheels only, torch/triton/transformers held, rolled back on failure.

`PipInstaller` runs `python -m pip install --only-binary=:all:` in a subprocess with a constraints file that
holds torch, triton and transformers at their installed versions, proves an install by importing it in a
child process (`check_import`), and can undo one (`rollback`). `provision.py` decides when to call it;
tests pass a fake with the same four methods (`Installer`).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

from hybridtune.kernels.environment import TRUE_WORDS

ENV_OFFLINE = "HYBRIDTUNE_OFFLINE"
# Never moved by an install: the user's torch build (and what it was built with) stays as it is.
HELD_PACKAGES = ("torch", "triton", "transformers")


@dataclass
class InstallResult:
    ok: bool
    command: list[str]
    output: str = ""
    changed: dict[str, tuple[str | None, str | None]] = field(default_factory=dict)  # dist -> (before, after)
    offline: bool = False  # refused for lack of network/index: the command is what the user runs instead


class Installer(Protocol):
    """What `provision_kernels` needs from an installer; tests pass a fake."""

    def command(self, specs: list[str]) -> list[str]: ...

    def install(self, specs: list[str]) -> InstallResult: ...

    def check_import(self, code: str) -> tuple[bool, str]: ...

    def rollback(self, result: InstallResult) -> tuple[bool, str]: ...


_SNAPSHOT = (
    "import importlib.metadata as m, json; "
    "print(json.dumps({d.metadata['Name'].lower().replace('_', '-'): d.version "
    "for d in m.distributions() if d.metadata['Name']}))"
)

_OFFLINE_HINTS = (
    "Could not find a version that satisfies",
    "No matching distribution",
    "Network is unreachable",
    "Temporary failure in name resolution",
    "Failed to establish a new connection",
    "Max retries exceeded",
    "ProxyError",
)


class PipInstaller:
    """`python -m pip install` into `python`'s environment (default: this interpreter), wheels only, with
    torch/triton/transformers held at that environment's versions by a constraints file.

    `HYBRIDTUNE_WHEELHOUSE=DIR` (or `wheelhouse=`) installs from a local folder of wheels and nothing else
    (`--no-index --find-links DIR`), for machines without a package index.
    """

    def __init__(
        self,
        python: str | None = None,
        timeout_s: float = 900.0,
        env: Mapping[str, str] | None = None,
        wheelhouse: str | None = None,
    ):
        self.python = python or sys.executable
        self.timeout_s = timeout_s
        self.env = os.environ if env is None else env
        wheelhouse = wheelhouse or self.env.get("HYBRIDTUNE_WHEELHOUSE")
        self.source_args = ["--no-index", "--find-links", wheelhouse] if wheelhouse else []

    def _run(self, args: list[str], timeout: float | None = None) -> tuple[bool, str]:
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=timeout or self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as e:
            return False, f"{type(e).__name__}: {e}"
        return p.returncode == 0, (p.stdout or "") + (p.stderr or "")

    def distributions(self) -> dict[str, str]:
        """{normalised distribution name: version} installed for `python`."""
        ok, out = self._run([self.python, "-c", _SNAPSHOT], timeout=120)
        if not ok:
            return {}
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {}

    def command(self, specs: list[str]) -> list[str]:
        return [self.python, "-m", "pip", "install", "--only-binary=:all:", *self.source_args, *specs]

    def install(self, specs: list[str]) -> InstallResult:
        cmd = self.command(specs)
        if self.env.get(ENV_OFFLINE, "").strip().lower() in TRUE_WORDS:
            return InstallResult(False, cmd, f"{ENV_OFFLINE} is set: not installing", offline=True)
        before = self.distributions()
        held = [f"{name}=={before[name]}" for name in HELD_PACKAGES if name in before]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write("\n".join(held) + "\n")
            constraints = f.name
        try:
            ok, output = self._run([*cmd, "--constraint", constraints, "--disable-pip-version-check", "--no-input"])
        finally:
            os.unlink(constraints)
        importlib.invalidate_caches()
        after = self.distributions()
        changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
        offline = not ok and any(h in output for h in _OFFLINE_HINTS)
        return InstallResult(ok, cmd, output[-4000:], changed, offline)

    def check_import(self, code: str) -> tuple[bool, str]:
        ok, out = self._run([self.python, "-c", code], timeout=600)
        return ok, out[-2000:]

    def rollback(self, result: InstallResult) -> tuple[bool, str]:
        """Uninstall what the install added, put back the versions it moved or removed."""
        added = sorted(d for d, (old, _new) in result.changed.items() if old is None)
        restore = sorted(f"{d}=={old}" for d, (old, _new) in result.changed.items() if old is not None)
        out, ok = [], True
        if added:
            r_ok, r_out = self._run([self.python, "-m", "pip", "uninstall", "-y", *added])
            ok, out = ok and r_ok, out + [r_out]
        if restore:
            r_ok, r_out = self._run([self.python, "-m", "pip", "install", "--no-deps", *self.source_args, *restore])
            ok, out = ok and r_ok, out + [r_out]
        importlib.invalidate_caches()
        return ok, "".join(out)[-2000:]
