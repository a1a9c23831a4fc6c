"""`register` and `unregister` clear what consumers derived from the registry (`registry.on_change`): a mixer
registered after those caches were filled is taken at once, and gone once unregistered."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridtune.bench import modes  # noqa: E402
from hybridtune.compiler import recompute  # noqa: E402
from hybridtune.kernels.needs import GATES, kernel_spec  # noqa: E402
from hybridtune.mixers import MIXERS, MixerSpec, register, registry, unregister  # noqa: E402
from hybridtune.mixers.registry import KernelPackage  # noqa: E402
from hybridtune.runtime import profiling  # noqa: E402

KIND = "cache-probe"
KERNEL = "cache_probe_scan_fwd_kernel"
GATE = "is_cache_probe_available"
PACKAGE = KernelPackage(
    name="cache_probe",
    distributions=(),
    check_code="import cache_probe",
    accelerates="a probe",
    fallback_cost="none",
    fix="none",
    gates=(GATE,),
    covers=("mamba_ssm",),
)


def _spec() -> MixerSpec:
    return MixerSpec(
        kind=KIND,
        core_ops=lambda: {torch.ops.aten.cumsum.default},
        profile_patterns=("cache probe", ("cache_probe_",)),
        kernels=(PACKAGE,),
        graph_forms={"probe": ("one", "two")},
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


def test_the_bench_takes_a_mixers_graph_forms_as_mode_options(probe):
    assert "probe" not in modes.OPTION_KEYS
    register(_spec())
    assert modes.FORMS["probe"] == modes.OPTION_KEYS["probe"] == ("one", "two")
    unregister(KIND)
    assert "probe" not in modes.FORMS and modes.OPTION_KEYS["conv"] == modes.FORMS["conv"]


def test_a_mixers_kernel_package_brings_its_gates_and_what_it_covers(probe):
    """The kernel resolver's gate table (filled at import) and the substitutes follow the registry."""
    assert GATE not in GATES and kernel_spec("mamba_ssm").substitute is None
    register(_spec())
    assert GATES[GATE] == "cache_probe" and kernel_spec("mamba_ssm").substitute == "cache_probe"
    unregister(KIND)
    assert GATE not in GATES and kernel_spec("mamba_ssm").substitute is None
    assert GATES["is_flash_linear_attention_available"] == "fla" == kernel_spec("causal_conv1d").substitute


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
