"""The CUDA tests of FLA's kernels run the device self-test first, as `hybridtune doctor` and training do.

On Hopper with Triton < 3.7.1, FLA 0.6 refuses the gated delta rule backward (fla #640) unless
`hybridtune.mixers.gdn.fla_guard` holds a grant for the head layout, and only `hybridtune.kernels.selftest.verify`
grants one, after its numeric check passed on this device. So a CUDA test of the FLA path asks the
`fla_selftest` fixture for its layout: the self-test runs once per layout per session (never from a cache), a
pass grants the layout and the test runs, a failure fails the test with the self-test's reason (a kernel with
wrong gradients is what these tests are for; it must never read as a skip). Without a GPU the `cuda` marker
skips (tests/conftest.py); on a GPU without a usable FLA there is nothing fast to test and the fixture skips.
"""

from __future__ import annotations

import pytest


class FlaSelftest:
    """The device self-test, once per head layout, turned into a test's outcome.

    `verify` is `hybridtune.kernels.selftest.verify` (tests pass a fake). `require(key)` returns the passing
    GDN verdict for (H, HV, K, V) after checking that the layout is granted, and fails the calling test
    otherwise; `conv(key)` does the same for the conv verdict of that layout's channel count.
    """

    def __init__(self, verify, device: str = "cuda", cache_dir: str | None = None):
        self._verify = verify
        self._device = device
        self._cache_dir = cache_dir  # where the self-test writes its verdicts (not the user's cache)
        self._verdicts: dict[tuple, dict[str, object]] = {}

    def _run(self, key) -> dict[str, object]:
        from hybridtune.mixers.gdn.selftest import Layout

        key = tuple(int(x) for x in key)
        if key not in self._verdicts:
            with pytest.MonkeyPatch.context() as mp:
                if self._cache_dir:
                    mp.setenv("HYBRIDTUNE_CACHE_DIR", self._cache_dir)
                verdicts = self._verify([Layout(*key)], use_cache=False)
            self._verdicts[key] = {v.kernel: v for v in verdicts if v.layout.key == key}
        return self._verdicts[key]

    def _check(self, key, kernel: str):
        v = self._run(key).get(kernel)
        where = f"{kernel} (H, HV, K, V) = {tuple(key)} on {self._device}"
        if v is None:
            pytest.fail(f"the kernel self-test returned no {kernel} verdict for {where}")
        if v.passed is not True:
            word = "FAILED" if v.passed is False else "did not run"
            fix = f" Fix: {v.fix}" if v.fix else ""
            pytest.fail(f"kernel self-test {word} for {where}: {v.reason}.{fix}", pytrace=False)
        return v

    def require(self, key):
        from hybridtune.mixers.gdn import fla_guard

        v = self._check(key, "gdn_chunk")
        if not fla_guard.is_granted(key):
            pytest.fail(f"the kernel self-test passed for {tuple(key)} but left no fla_guard grant", pytrace=False)
        return v

    def conv(self, key):
        return self._check(key, "causal_conv1d")


@pytest.fixture(scope="session")
def fla_selftest():
    """A `FlaSelftest` over the real self-test on CUDA device 0; skips without a GPU or without a usable FLA.
    Grants made for the session are withdrawn at its end; the self-test cache goes to a temporary folder."""
    import os
    import tempfile

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from hybridtune.kernels.selftest import verify
    from hybridtune.mixers.gdn import fla_guard
    from hybridtune.mixers.gdn import ops as gdn

    backend, why = gdn.backend("cuda")
    if backend != "fla":
        pytest.skip(f"flash-linear-attention is not usable here: {why}")
    before = set(fla_guard.granted())
    with tempfile.TemporaryDirectory(prefix="hybridtune-selftest-") as cache:
        yield FlaSelftest(verify, torch.cuda.get_device_name(0), os.path.join(cache, "cache"))
    for key in set(fla_guard.granted()) - before:
        fla_guard.revoke(key)


@pytest.fixture
def fla_selftest_class():
    """The class itself, for CPU tests of the pass / fail / grant decisions with a fake self-test."""
    return FlaSelftest
