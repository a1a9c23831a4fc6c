"""Which kernels run the GDN chunk (the gated delta rule): FLA's Triton kernels or FlashQLA's, as FLA decides.

FLA 0.6.0 registers FlashQLA (`flash-qla`, Qwen's TileLang kernels) as a backend of its public
`chunk_gated_delta_rule` (`fla.ops.gated_delta_rule.backends.flash_qla.FlashQLABackend`, priority 3): when the
`flash_qla` package is findable, `FLA_FLASH_QLA` is not "0" and FLA's per-call verifier accepts the call (Hopper,
SM100/103, or SM120 forward only; bf16/fp16; K = V = 128; ...), FLA runs `flash_qla` instead of its Triton kernels.
`FLA_DISABLE_BACKEND_DISPATCH=1` (read at FLA's import) turns every such dispatch off. hybridtune's custom ops call
FLA's raw forward/backward, which do not dispatch: so they follow the same decision here, computed by FLA's own
registry objects (`decide`), and call `flash_qla`'s raw forward/backward when it says FlashQLA.

`gdn_backend: auto | fla-triton | flash-qla` (config key, `pin`) sets `FLA_FLASH_QLA` before FLA is imported, so a
plain transformers model (which calls FLA's public entry) and hybridtune's ops agree. The ops take FlashQLA only for a
head layout the device self-test granted to it (`fla_guard`, keyed by backend); otherwise they run FLA's Triton
kernels and say so once (`fall back loudly`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

from hybridtune.errors import ConfigError
from hybridtune.mixers.registry import BackendOption
from hybridtune.versions import dist_version

log = logging.getLogger(__name__)

TRITON, FLASH_QLA = "fla-triton", "flash-qla"
CHOICES = ("auto", TRITON, FLASH_QLA)
ENV = "FLA_FLASH_QLA"  # FlashQLABackend.env_var in FLA 0.6.0; "0" turns the dispatch off
ENV_DISPATCH = "FLA_DISABLE_BACKEND_DISPATCH"  # "1" at FLA's import: no backend dispatch at all
PACKAGE = "flash_qla"
FLA_TYPE = "flash_qla"  # FlashQLABackend.backend_type
# The user's pin: config key `gdn_backend` (its declaration in config/kernels.py lists CHOICES), overridden by
# HYBRIDTUNE_GDN_BACKEND; kernels/provision.py applies it through the suite's `pin` before FLA's import.
OPTION = BackendOption(key="gdn_backend", env="HYBRIDTUNE_GDN_BACKEND", choices=CHOICES)

_PIN = ["auto"]
_FORCED: list[str | None] = [None]


@dataclass(frozen=True)
class Choice:
    """The GDN chunk backend for one head layout on one device: `name` (TRITON or FLASH_QLA) and why."""

    name: str
    why: str
    version: str | None = None  # flash-qla's, when name is FLASH_QLA

    @property
    def label(self) -> str:
        """`fla-triton` or `flash-qla 0.1.3 via fla` (what reports print and verdicts are keyed by)."""
        return f"{FLASH_QLA} {self.version or '?'} via fla" if self.name == FLASH_QLA else TRITON


def installed() -> bool:
    """Whether `flash_qla` is findable, as FLA's `BaseBackend.is_available` asks (find_spec, no import)."""
    if PACKAGE in sys.modules:
        return sys.modules[PACKAGE] is not None
    try:
        return importlib.util.find_spec(PACKAGE) is not None
    except (ImportError, ValueError):
        return False


def version() -> str | None:
    """flash-qla's version: its distribution's, else the module's `__version__` (a module found some other way)."""
    v = dist_version("flash-qla", "flash_qla")
    if v is None and sys.modules.get(PACKAGE) is not None:
        v = getattr(sys.modules[PACKAGE], "__version__", None)
    return v


def pin(choice: str | None, where: str = OPTION.key) -> str:
    """Pin the GDN chunk backend for this process: set FLA's switch (`FLA_FLASH_QLA`) before FLA is imported.
    `auto` leaves FLA's own decision (and the environment) alone. Returns the pin; ConfigError on a bad value or on
    `flash-qla` when the package is not installed."""
    choice = "auto" if choice is None else str(choice)
    if choice not in CHOICES:
        raise ConfigError(f"{where}: '{choice}' is not one of {', '.join(CHOICES)}")
    if choice == FLASH_QLA and not installed():
        raise ConfigError(
            f"{where}: flash-qla is pinned but the flash-qla package is not installed: pip install flash-qla "
            "(it needs tilelang and nvcc), or set gdn_backend: auto or fla-triton"
        )
    if choice != "auto":
        if "fla.backends" in sys.modules and os.environ.get(ENV) not in (None, "0" if choice == TRITON else "1"):
            log.warning("%s: %s pinned after FLA was imported; FLA reads %s per call, so it holds", where, choice, ENV)
        os.environ[ENV] = "0" if choice == TRITON else "1"
    _PIN[0] = choice
    decide_cached.cache_clear()
    return choice


def pinned() -> str:
    return _PIN[0]


@contextlib.contextmanager
def forced(name: str | None):
    """Run the body with the ops on backend `name` (the self-test's trial of each backend); None: as decided."""
    if name not in (None, TRITON, FLASH_QLA):
        raise ValueError(f"forced: backend must be {TRITON!r} or {FLASH_QLA!r}, got {name!r}")
    old, _FORCED[0] = _FORCED[0], name
    try:
        yield
    finally:
        _FORCED[0] = old


def _meta_call(key: tuple[int, int, int, int]):
    """Arguments of a bf16 training call of FLA's `chunk_gated_delta_rule` for head layout `key`, on the meta device:
    FLA's verifiers read shapes, dtypes and `requires_grad` only."""
    import torch  # why here: the resolver is read (names, pin) where torch need not load

    H, HV, K, V = key
    meta, bf16 = torch.device("meta"), torch.bfloat16
    q, k = (torch.empty(1, 64, H, K, device=meta, dtype=bf16, requires_grad=True) for _ in range(2))
    v = torch.empty(1, 64, HV, V, device=meta, dtype=bf16, requires_grad=True)
    g = torch.empty(1, 64, HV, device=meta, dtype=torch.float32, requires_grad=True)
    beta = torch.empty(1, 64, HV, device=meta, dtype=bf16, requires_grad=True)
    cu = torch.empty(2, device=meta, dtype=torch.int32)
    return (q, k, v, g, beta), {"scale": K**-0.5, "use_qk_l2norm_in_kernel": True, "cu_seqlens": cu}


def decide(key: tuple[int, int, int, int]) -> Choice:
    """The backend FLA's public `chunk_gated_delta_rule` dispatches a bf16 training call of head layout `key` to on
    the current device, by FLA's own registry: the first backend by priority that is available, enabled and accepts
    the call (as `fla.backends.BackendRegistry.dispatch`). Its Triton kernels when none does or FLA has no registry."""
    key = tuple(int(x) for x in key)
    try:
        backends = importlib.import_module("fla.backends")
        registry = backends._load_operation_registry("gated_delta_rule")
    except Exception as e:
        return Choice(TRITON, f"FLA has no backend registry for the gated delta rule ({type(e).__name__})")
    if getattr(backends, "_DISPATCH_DISABLED", False):
        return Choice(TRITON, f"{ENV_DISPATCH}=1: FLA dispatches to no backend")
    import torch  # why here: as in _meta_call

    args, kwargs = _meta_call(key)
    rejected = []
    with torch.enable_grad():
        for b in registry._get_sorted_backends():
            if not (b.is_available() and b.is_enabled()):
                if b.backend_type == FLA_TYPE:
                    rejected.append(
                        f"{FLA_TYPE}: " + ("turned off by FLA_FLASH_QLA=0" if installed() else "not installed")
                    )
                continue
            ok, reason = b.verify("chunk_gated_delta_rule", *args, **kwargs)
            if not ok:
                rejected.append(f"{b.backend_type}: {reason}")
                continue
            if b.get_implementation("chunk_gated_delta_rule") is None:
                continue
            if b.backend_type == FLA_TYPE:
                return Choice(FLASH_QLA, f"FLA dispatches the gated delta rule of {key} to flash_qla", version())
            return Choice(TRITON, f"FLA would dispatch to its {b.backend_type} backend, which hybridtune's ops lack")
    return Choice(TRITON, "FLA's Triton kernels" + (f" ({'; '.join(rejected)})" if rejected else ""))


@functools.lru_cache(maxsize=64)
def _decide(key: tuple, env: str | None, pin_: str) -> Choice:
    choice = decide(key)
    if pin_ == FLASH_QLA and choice.name != FLASH_QLA:
        log.warning("gdn_backend: flash-qla is pinned, but FLA does not take it for %s: %s", key, choice.why)
        return Choice(TRITON, f"flash-qla pinned but refused here: {choice.why}")
    return choice


def decide_cached(key: tuple) -> Choice:
    """`decide`, cached per layout, FLA_FLASH_QLA value and pin (the ops ask on every call)."""
    return _decide(tuple(int(x) for x in key), os.environ.get(ENV), _PIN[0])


decide_cached.cache_clear = _decide.cache_clear  # type: ignore[attr-defined]


def for_op(key: tuple) -> Choice:
    """The backend the ops run for head layout `key`: a forced one (self-test), else FLA's decision, with FlashQLA
    taken only when the self-test granted it for this layout (else FLA's Triton kernels, said once)."""
    from hybridtune.mixers.gdn import fla_guard  # why here: fla_guard is a sibling with no dependency on this

    forced_name = _FORCED[0]
    if forced_name == TRITON:
        return Choice(TRITON, "forced (self-test)")
    if forced_name == FLASH_QLA:
        return Choice(FLASH_QLA, "forced (self-test)", version())
    choice = decide_cached(key)
    if choice.name == FLASH_QLA and not fla_guard.is_granted(key, FLASH_QLA):
        msg = (
            f"GDN chunk {tuple(key)}: FLA would run flash-qla {choice.version}, which the device self-test has not "
            "passed for this head layout here: running FLA's Triton kernels (run `hybridtune doctor`; "
            "gdn_backend: fla-triton silences this)"
        )
        _warn_once(msg)
        return Choice(TRITON, "flash-qla not granted by the self-test; FLA's Triton kernels")
    return choice


_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)
