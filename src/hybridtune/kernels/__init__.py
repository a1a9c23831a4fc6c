"""Kernel resolver: which fast kernels an architecture needs, which path each mixer takes, provisioning
under a policy, and a numeric self-test on the device before a kernel is trusted.

- `needs(config_or_model_type) -> set[str]`: from what the modeling module asks for, never the model's name.
- `report(model) -> PathReport`: per-mixer path of a built model.
- `provision_kernels(policy, require_fast_path, config)` (`provision.py`): call before the modeling import.
- `hybridtune doctor [--model M] [--json]`: all of it, for people.

Inside: `needs.py`, `gates.py` (transformers' availability gates), `paths.py`, `provision.py` (the policy),
`install.py` (the pip installer), `selftest.py`, `environment.py` (versions, git commit, GPU, cache directory),
`doctor.py`.
"""

from __future__ import annotations

from hybridtune.kernels.needs import analyze, needs
from hybridtune.kernels.paths import report

__all__ = ["analyze", "needs", "report", "provision_kernels"]


def provision_kernels(policy, require_fast_path, model_type_or_config, **kwargs):
    """Provision and verify kernels before the modeling import (see `hybridtune.kernels.provision`)."""
    # why here: provision imports selftest, and `python -m hybridtune.kernels.selftest` must not find it
    # already imported by its package (runpy warns and runs a second copy).
    from hybridtune.kernels.provision import provision_kernels as provision

    return provision(policy, require_fast_path, model_type_or_config, **kwargs)
