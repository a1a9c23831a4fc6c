"""The one place that knows FLA's internal function names and arities (0.5.x and 0.6.x).

FLA's public entry points are `@torch.compiler.disable` and derive chunk indices on the host, so
the custom ops call FLA's raw forward/backward functions instead. Their module paths and return
arities moved between releases; this adapter resolves them once and fails with a message that names
the supported range for anything else.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

from hybridtune.versions import dist_version

SUPPORTED = ("0.5", "0.6")  # major.minor of flash-linear-attention / fla-core releases tested


class FLAUnavailable(RuntimeError):
    """FLA is missing, or its version is outside the range the adapter knows."""


@dataclass(frozen=True)
class FLA:
    version: str
    gdn_fwd: Callable  # returns (g_cum, o, A, final_state, initial_state, g_input)
    gdn_bwd: Callable  # returns (dq, dk, dv, dbeta, dg, dh0, dA_log, ddt_bias)
    l2norm_fwd: Callable  # x -> (y, rstd)
    l2norm_bwd: Callable  # (y, rstd, dy) -> dx
    conv_fwd: Callable  # returns (y, final_state)
    conv_bwd: Callable  # returns (dx, dw, db, dresidual, dh0)


def _first(*paths: str):
    err = None
    for path in paths:
        mod_name, _, attr = path.rpartition(".")
        try:
            return getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            err = e
    raise FLAUnavailable(f"none of {paths} found in the installed FLA: {err}")


@functools.cache
def _accepted(fn: Callable) -> frozenset | None:
    """Keyword names `fn` accepts, or None when it takes **kwargs (cached: signature() is slow per call)."""
    params = inspect.signature(inspect.unwrap(fn)).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return frozenset(params)


def keywords(fn: Callable, **kwargs):
    """Call `fn` with only the keyword arguments its signature accepts (names differ across releases)."""
    names = _accepted(fn)
    if names is None:
        return fn(**kwargs)
    return fn(**{k: v for k, v in kwargs.items() if k in names})


@functools.cache
def load() -> FLA:
    """Resolve FLA's raw GDN and conv functions, or raise `FLAUnavailable` saying why."""
    version = dist_version("fla-core", "flash-linear-attention")
    if version is None:
        raise FLAUnavailable("flash-linear-attention is not installed (pip install flash-linear-attention fla-core)")
    try:
        importlib.import_module("fla.ops.gated_delta_rule.chunk")
    except Exception as e:
        raise FLAUnavailable(f"flash-linear-attention {version} is installed but does not import: {e}") from e
    if ".".join(version.split(".")[:2]) not in SUPPORTED:
        raise FLAUnavailable(
            f"flash-linear-attention {version} is outside the range hybridtune supports "
            f"({', '.join(v + '.x' for v in SUPPORTED)}); install flash-linear-attention>=0.5,<0.7"
        )
    chunk = importlib.import_module("fla.ops.gated_delta_rule.chunk")
    return FLA(
        version=version,
        gdn_fwd=chunk.chunk_gated_delta_rule_fwd,
        gdn_bwd=chunk.chunk_gated_delta_rule_bwd,
        l2norm_fwd=_first("fla.modules.norm.l2norm.l2norm_fwd", "fla.modules.l2norm.l2norm_fwd"),
        l2norm_bwd=_first("fla.modules.norm.l2norm.l2norm_bwd", "fla.modules.l2norm.l2norm_bwd"),
        conv_fwd=_first(
            "fla.modules.causal_conv1d.ops.causal_conv1d_fwd", "fla.modules.conv.triton.ops.causal_conv1d_fwd"
        ),
        conv_bwd=_first(
            "fla.modules.causal_conv1d.ops.causal_conv1d_bwd", "fla.modules.conv.triton.ops.causal_conv1d_bwd"
        ),
    )


def flash_qla():
    """The `flash_qla` module (its raw `chunk_gated_delta_rule_fwd` / `_bwd`), imported on first use: the ops call
    it only where `backend.for_op` chose FlashQLA, which needs it findable. FLAUnavailable when it does not import."""
    try:
        return importlib.import_module("flash_qla")
    except Exception as e:
        raise FLAUnavailable(f"flash-qla was chosen for the GDN chunk but does not import: {e}") from e


_TURNED_OFF: str | None = None


def turn_off(reason: str | None) -> None:
    """Keep hybridtune's ops off FLA in this process (`kernels: off`), `reason` saying why; None allows it again.
    Installed FLA is otherwise used as soon as it imports, and on Hopper its backward needs the device self-test
    that `off` skips: without this switch a `kernels: off` run crashed in its first backward."""
    global _TURNED_OFF
    _TURNED_OFF = reason


def available() -> tuple[bool, str]:
    """(ok, reason): whether the CUDA path can use FLA, and why not."""
    if _TURNED_OFF is not None:
        return False, _TURNED_OFF
    try:
        f = load()
    except FLAUnavailable as e:
        return False, str(e)
    return True, f"flash-linear-attention {f.version}"


def disable_tensor_cache() -> bool:
    """Turn off FLA's identity-keyed tensor cache (`fla.utils.tensor_cache`) for this process.

    FLA memoises tensors it derives from `cu_seqlens` (`prepare_lens`, `prepare_chunk_offsets`, called inside
    its raw forward and backward). Under CUDA graphs those tensors are allocated in the graph's memory pool
    and then kept alive by the cache, which cudagraph trees refuse ("tensor(s) in the cudagraph pool not
    tracked as outputs", with the compiled loop). Without the cache they are recomputed
    per call (a few tiny kernels) and freed with the step. FLA reads the switch at call time from
    `fla.utils.FLA_DISABLE_TENSOR_CACHE` (0.6.x; the env var of the same name sets it at import).
    Returns True when the switch exists and is now off, False when FLA is absent or has no such switch.
    """
    try:
        utils = importlib.import_module("fla.utils")
    except Exception:
        return False
    if not hasattr(utils, "FLA_DISABLE_TENSOR_CACHE"):
        return False
    utils.FLA_DISABLE_TENSOR_CACHE = True
    return True
