"""Scoped, per-shape lifting of FLA's Hopper guard on the gated delta rule backward.

FLA 0.6.0 refuses `chunk_bwd_dqkwg` (the gated backward) on Hopper with Triton >= 3.4.0, < 3.7.1
(`fla/ops/common/chunk_o.py`: `if g is not None and IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not
TRITON_ABOVE_3_7_1: raise RuntimeError(...)`), because of a Triton miscompile (fla #640) that shows
at some block shapes. For the Qwen3.5 head layouts the backward was measured correct (docs/FINDINGS.md),
so the guard is wider than the bug; but it is lifted only for head layouts that a numeric self-test
on this device has verified (the kernels subsystem calls `grant`), or that a benchmark grants
explicitly and says so in its output. Nothing here changes FLA globally: `lifted(key)` sets the
module-level `IS_NVIDIA_HOPPER` that the guard reads to False for the duration of one backward call
and restores it after.

Key: (H, HV, K, V) = (key heads, value heads, key head dim, value head dim), per backend of the GDN chunk
(`backend.TRITON` or `backend.FLASH_QLA`): a grant for FLA's Triton kernels does not cover FlashQLA's, nor the
reverse. The ops take FlashQLA for a layout only while it holds a FlashQLA grant (`backend.for_op`).
"""

from __future__ import annotations

import contextlib
import threading

_GRANTS: dict[tuple, str] = {}  # (backend, H, HV, K, V) -> source
_LOCK = threading.RLock()

GUARD_MODULE = "fla.ops.common.chunk_o"
# The one name the guard reads at call time in both 0.5.x (`IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0`)
# and 0.6.x (`... and not TRITON_ABOVE_3_7_1`); elsewhere in that module it is only read at import.
GUARD_FLAG = "IS_NVIDIA_HOPPER"
TRITON = "fla-triton"  # = backend.TRITON (the default backend of a grant)
BACKENDS = (TRITON, "flash-qla")


def _key(key) -> tuple:
    key = tuple(int(x) for x in key)
    if len(key) != 4:
        raise ValueError(f"FLA guard key must be (H, HV, K, V), got {key}")
    return key


def _backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"FLA guard backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def grant(key: tuple, source: str, backend: str = TRITON) -> None:
    """Allow the GDN chunk of head layout `key` = (H, HV, K, V) on `backend` (FLA's Triton backward: past FLA's
    Hopper guard; FlashQLA: at all); `source` says who verified it
    (e.g. "kernels.selftest: max rel err <error> on <device>" or "bench: explicit grant")."""
    if not source:
        raise ValueError("fla_guard.grant needs a source naming who verified this head layout")
    with _LOCK:
        _GRANTS[(_backend(backend), *_key(key))] = str(source)


def revoke(key: tuple, backend: str = TRITON) -> None:
    """Withdraw a grant (a failed self-test; tests)."""
    with _LOCK:
        _GRANTS.pop((_backend(backend), *_key(key)), None)


def is_granted(key, backend: str = TRITON) -> bool:
    return (_backend(backend), *_key(key)) in _GRANTS


def granted(backend: str = TRITON) -> dict:
    """{(H, HV, K, V): source} of every grant to `backend` so far."""
    return {k[1:]: v for k, v in dict(_GRANTS).items() if k[0] == backend}


def guard_active() -> bool:
    """True when the installed FLA would refuse the gated backward on this device."""
    try:
        import importlib

        mod = importlib.import_module(GUARD_MODULE)
    except Exception:
        return False
    return bool(
        getattr(mod, "IS_NVIDIA_HOPPER", False)
        and getattr(mod, "TRITON_ABOVE_3_4_0", False)
        and not getattr(mod, "TRITON_ABOVE_3_7_1", False)
    )


@contextlib.contextmanager
def lifted(key):
    """Run the body with FLA's Hopper guard off if `key` is granted; otherwise leave it as it is
    and turn FLA's refusal into an error that names the fix."""
    import importlib

    key = _key(key)
    mod = importlib.import_module(GUARD_MODULE)
    if (TRITON, *key) in _GRANTS and hasattr(mod, GUARD_FLAG):
        with _LOCK:
            old = getattr(mod, GUARD_FLAG)
            setattr(mod, GUARD_FLAG, False)
            try:
                yield
            finally:
                setattr(mod, GUARD_FLAG, old)
        return
    try:
        yield
    except RuntimeError as e:
        if "#640" not in str(e):
            raise
        raise RuntimeError(
            f"FLA refuses the gated delta rule backward on this GPU (Hopper + Triton < 3.7.1, fla #640) "
            f"for head layout (H, HV, K, V) = {key}. hybridtune lifts that guard only for head layouts "
            "verified on this device: run the kernel self-test (`hybridtune doctor`), which calls "
            f"hybridtune.mixers.gdn.fla_guard.grant({key}, source), or upgrade Triton to >= 3.7.1. "
            f"Granted so far: {sorted(granted()) or 'none'}."
        ) from e
