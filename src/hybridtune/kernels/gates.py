"""Hooks on transformers' kernel availability gates (gate-style releases, 5.13 to 5.15).

In those releases a modeling module decides its fast path once, at import, through `lru_cache`d gates
(`is_flash_linear_attention_available()`, `is_causal_conv1d_available()`, the mamba gates). Each hook's first call
clears the gate's cache, asks the original, on `False` calls `on_false(kernel, gate)` (the provisioning policy) and,
if that provisioned something, clears the cache and asks once more; every later call returns the first answer. The
wrapper replaces the gate on `transformers.utils.import_utils` and in every already-imported module that bound it by
name. A no-op without transformers; disabled by `HYBRIDTUNE_NO_GATE_HOOKS=1`; on 5.16+ provisioning happens before
the modeling import instead (provision.py).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hybridtune.kernels.needs import GATES

logger = logging.getLogger(__name__)

ENV_DISABLE = "HYBRIDTUNE_NO_GATE_HOOKS"
_IMPORT_UTILS = "transformers.utils.import_utils"
_MARK = "_hybridtune_gate_hook"


@dataclass
class GateEvent:
    """The first call of one hooked gate."""

    gate: str
    kernel: str
    first: bool  # what the original said before provisioning
    provisioned: bool  # whether `on_false` reported an install
    final: bool  # what the gate answers from now on


@dataclass
class GateHooks:
    """The installed hooks: originals, wrappers, where they were rebound, what fired."""

    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)
    wrappers: dict[str, Callable[..., Any]] = field(default_factory=dict)
    rebound: list[str] = field(default_factory=list)  # "module.name" of every rebinding
    events: list[GateEvent] = field(default_factory=list)
    on_false: Callable[[str, str], bool] | None = None  # the policy asked on a gate's first False

    def to_dict(self) -> dict[str, Any]:
        return {
            "gates": sorted(self.wrappers),
            "rebound": len(self.rebound),
            "events": [vars(e) for e in self.events],
        }


_ACTIVE: GateHooks | None = None


def disabled(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    return env.get(ENV_DISABLE, "").strip().lower() in ("1", "true", "yes", "on")


def active() -> GateHooks | None:
    return _ACTIVE


def _clear_cache(fn: Callable[..., Any]) -> None:
    clear = getattr(fn, "cache_clear", None)
    if callable(clear):
        clear()


def _make_wrapper(gate: str, kernel: str, original: Callable[..., Any], hooks: GateHooks) -> Callable[..., Any]:
    state: dict[str, bool] = {}

    def wrapper(*args: Any, **kwargs: Any) -> bool:
        if "answer" in state:  # short-circuit: the first call decided
            return state["answer"]
        _clear_cache(original)
        first = bool(original(*args, **kwargs))
        answer, provisioned = first, False
        if not first and hooks.on_false is not None:
            try:
                provisioned = bool(hooks.on_false(kernel, gate))
            except Exception as e:  # a broken installer must not break the model import
                logger.warning("provisioning %s for %s() failed: %s", kernel, gate, e)
            if provisioned:
                importlib.invalidate_caches()
                reset_lazy_kernels()
                _clear_cache(original)
                answer = bool(original(*args, **kwargs))
        state["answer"] = answer
        hooks.events.append(GateEvent(gate, kernel, first, provisioned, answer))
        return answer

    def cache_clear() -> None:
        state.clear()
        _clear_cache(original)

    wrapper.__name__ = wrapper.__qualname__ = gate
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
    setattr(wrapper, _MARK, True)
    if getattr(original, "_dynamo_marked_constant", False):  # keep transformers' compile-constant marker
        wrapper._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return wrapper


def _rebind(old: Callable[..., Any], new: Callable[..., Any], name: str, skip: set[str]) -> list[str]:
    """Replace `name` bound to `old` in every imported module; the local bindings `from x import name` made."""
    done = []
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name in skip:
            continue
        try:
            namespace = vars(mod)
        except TypeError:
            continue
        if namespace.get(name) is old:
            namespace[name] = new
            done.append(f"{mod_name}.{name}")
    return done


def install_gate_hooks(
    on_false: Callable[[str, str], bool] | None,
    gates: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
) -> GateHooks | None:
    """Wrap transformers' kernel gates (see module doc). Returns the hooks, or None when disabled/absent.

    `on_false(kernel, gate) -> bool` is called at most once per gate, on its first `False`; it returns whether
    it installed the kernel. Calling this again while hooks are active adds no second layer: it returns the
    active hooks with `on_false` replaced (a later `prepare` brings its own policy).
    """
    global _ACTIVE
    if disabled(env):
        logger.info("gate hooks disabled by %s", ENV_DISABLE)
        return None
    if _ACTIVE is not None:
        _ACTIVE.on_false = on_false
        return _ACTIVE
    try:
        import_utils = importlib.import_module(_IMPORT_UTILS)
    except ImportError:
        return None  # no transformers: nothing to hook
    hooks = GateHooks(on_false=on_false)
    for gate, kernel in (GATES if gates is None else gates).items():
        original = getattr(import_utils, gate, None)
        if original is None or not callable(original):
            continue
        if getattr(original, _MARK, False):  # hooked by an earlier install that was not removed cleanly
            original = original.__wrapped__
        wrapper = _make_wrapper(gate, kernel, original, hooks)
        hooks.originals[gate] = original
        hooks.wrappers[gate] = wrapper
        hooks.rebound += _rebind(original, wrapper, gate, skip={__name__})
        if getattr(import_utils, gate) is not wrapper:
            setattr(import_utils, gate, wrapper)
            hooks.rebound.append(f"{_IMPORT_UTILS}.{gate}")
    _ACTIVE = hooks
    logger.debug("hooked %d gates, %d bindings", len(hooks.wrappers), len(hooks.rebound))
    return hooks


def uninstall_gate_hooks() -> None:
    """Put the original gates back everywhere the wrappers were bound."""
    global _ACTIVE
    hooks, _ACTIVE = _ACTIVE, None
    if hooks is None:
        return
    for gate, wrapper in hooks.wrappers.items():
        _rebind(wrapper, hooks.originals[gate], gate, skip={__name__})


def clear_gate_caches(gates: Mapping[str, str] | None = None) -> list[str]:
    """Clear the `lru_cache` of each gate (hooked or not) so the next call probes the environment again."""
    import_utils = sys.modules.get(_IMPORT_UTILS)
    if import_utils is None:
        return []
    cleared = []
    for gate in GATES if gates is None else gates:
        fn = getattr(import_utils, gate, None)
        if fn is not None:
            _clear_cache(fn)
            inner = getattr(fn, "__wrapped__", None) if getattr(fn, _MARK, False) else None
            if inner is not None:
                _clear_cache(inner)
            cleared.append(gate)
    return cleared


def reset_lazy_kernels() -> list[str]:
    """Forget `lazy_load_kernel`'s cached misses (None), so a kernel installed since is found."""
    hub = sys.modules.get("transformers.integrations.hub_kernels")
    mapping = getattr(hub, "_KERNEL_MODULE_MAPPING", None)
    if not isinstance(mapping, dict):
        return []
    stale = [k for k, v in mapping.items() if v is None]
    for k in stale:
        del mapping[k]
    return stale
