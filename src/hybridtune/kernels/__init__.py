"""Kernel resolver: which fast kernels an architecture needs, which path each mixer takes, provisioning
under a policy, and a numeric self-test on the device before a kernel is trusted.

- `needs(config_or_model_type) -> set[str]`: from what the modeling module asks for, never the model's name.
- `report(model) -> PathReport`: per-mixer path of a built model.
- `hybridtune.kernels.provision.prepare(policy, require_fast_path, config)`: call before the modeling import.
- `hybridtune doctor [--model M] [--json]`: all of it, for people.
"""

from __future__ import annotations

from hybridtune.kernels.needs import analyze, needs

__all__ = ["analyze", "needs", "report", "prepare"]


def report(model):
    """Per-mixer path of a built model (see `hybridtune.kernels.paths.report`)."""
    from hybridtune.kernels.paths import report as _report

    return _report(model)


def prepare(policy, require_fast_path, model_type_or_config, **kwargs):
    """Provision and verify kernels before the modeling import (see `hybridtune.kernels.provision.prepare`)."""
    from hybridtune.kernels.provision import prepare as _prepare

    return _prepare(policy, require_fast_path, model_type_or_config, **kwargs)
