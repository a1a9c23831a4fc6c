"""Kernel-resolver tests: CPU only, no network, no real installs; gate hooks never leak between tests."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    from hybridtune.kernels import gates

    monkeypatch.setenv("HYBRIDTUNE_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("HYBRIDTUNE_KERNELS", "HYBRIDTUNE_REQUIRE_FAST_PATH", "HYBRIDTUNE_NO_GATE_HOOKS", "HYBRIDTUNE_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    yield
    gates.uninstall_gate_hooks()
