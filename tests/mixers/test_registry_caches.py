"""`register` and `unregister` clear what consumers derived from the registry (`registry.on_change`): a mixer
registered after those caches were filled is taken at once, and gone once unregistered."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridtune.compiler import recompute  # noqa: E402
from hybridtune.mixers import MIXERS, MixerSpec, register, registry, unregister  # noqa: E402
from hybridtune.runtime import profiling  # noqa: E402

KIND = "cache-probe"
KERNEL = "cache_probe_scan_fwd_kernel"


def _spec() -> MixerSpec:
    return MixerSpec(
        kind=KIND,
        core_ops=lambda: {torch.ops.aten.cumsum.default},
        profile_patterns=("cache probe", ("cache_probe_",)),
    )


@pytest.fixture
def probe():
    assert KIND not in MIXERS
    yield
    unregister(KIND)


def test_a_mixer_registered_after_the_caches_filled_is_taken(probe):
    kept, group = recompute.core_ops(), profiling.kernel_group(KERNEL)  # filled before the registration
    assert torch.ops.aten.cumsum.default not in kept and group != "cache probe"
    register(_spec())
    assert torch.ops.aten.cumsum.default in recompute.core_ops()
    assert profiling.kernel_group(KERNEL) == "cache probe"
    assert ("cache probe", ("cache_probe_",)) in profiling.kernel_groups()
    unregister(KIND)
    assert recompute.core_ops() == kept and profiling.kernel_group(KERNEL) == group


def test_on_change_runs_on_register_and_unregister_only(probe):
    calls = []
    clear = registry.on_change(lambda: calls.append(len(MIXERS)))
    try:
        n = len(MIXERS)
        register(_spec())
        assert unregister(KIND) is not None and unregister(KIND) is None  # the second removes nothing
        assert calls == [n + 1, n]
    finally:
        registry._CACHES.remove(clear)
