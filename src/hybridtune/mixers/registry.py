"""The mixer registry: one `MixerSpec` per mixer kind, what the rest of the package iterates instead of naming a
mixer. A new mixer is a folder `mixers/<kind>/` whose spec is one `register` call (mixers/__init__.py).

A spec says, for its kind: which HF modules it routes and how (`routing`), the `layer_types` entries of a config it
serves and what they cost (`flops`, `activations`: per token), the per-batch metadata the collator adds for it
(`metadata`, keyed `batch_keys`; `size` counts a batch's rows of its dim-0-dynamic keys), the ops whose outputs a
checkpoint may keep (`core_ops`), the kernel packages it needs (`kernels`), its device self-test (`selftest`, a
`SelfTestSuite`: its checks, the backend a user may pin, the autotuning tables it seeds), the process settings its
ops need before a graph is compiled (`graph_setup`), the profiler's kernel-name patterns (`profile_patterns`) and
the path report of a routed module (`path`). Everything here is torch-free at import: fields that need torch are
callables the consumers call when they run. A consumer that caches what it derived from `MIXERS` hands its
`cache_clear` to `on_change`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

# Set on a routed module (patching): the kind of the mixer whose forward it runs.
MIXER_ATTR = "_hybridtune_mixer"


@dataclass(frozen=True)
class Family:
    """One HF module layout a mixer routes, recognised by structure (`matches(module)`). Routed, its forward
    without a cache is `forward(module, hidden [B, T, D], attention_mask, batch_kwargs) -> [B, T, D]`."""

    name: str
    matches: Callable[[Any], bool]
    forward: Callable[..., Any]
    unsupported: Callable[[Any], str | None] = lambda module: None  # why it cannot be routed, or None
    describe: Callable[[Any], str] = lambda module: ""  # the patch report's line for a routed module


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of `layers` layers of one mixer over a packed batch (forward only; the FLOP model multiplies).

    `projections`: (path under the layer, in_features, out_features) of each weight matrix of one layer, charged
    like every linear weight. `core`: forward FLOPs of the core (recomputed under checkpointing unless kept),
    `weights`: per-token weight-like parameters outside the projections (a conv), counted like weights."""

    projections: tuple[tuple[str, int, int], ...]
    core: float = 0.0
    weights: int = 0


@dataclass(frozen=True)
class Activations:
    """Elements per token one layer of a mixer keeps: `saved` for its backward without checkpointing, `core` what a
    checkpoint that keeps the core holds, `backward_fp32` fp32 transients of its backward."""

    saved: int
    core: int = 0
    backward_fp32: int = 0


@dataclass(frozen=True)
class KernelPackage:
    """A fast-kernel package: how to check it, how to get it, and what its absence costs."""

    name: str  # the need's key, also the import name
    distributions: tuple[str, ...]  # pinned pip requirements; empty when there is no wheel to install
    check_code: str  # python run in a child process to prove the install imports
    accelerates: str
    fallback_cost: str
    fix: str  # the command (or step) that closes the gap
    substitute: str | None = None  # a kernel whose own op replaces this one on hybridtune's path
    gates: tuple[str, ...] = ()  # transformers' availability gates that ask for it (`is_..._available`)
    covers: tuple[str, ...] = ()  # other packages whose work its ops do on hybridtune's path (their `substitute`)
    # Keep hybridtune's ops off this package in this process (`kernels: off`, the reason), or allow it again (None).
    turn_off: Callable[[str | None], None] | None = None


@dataclass(frozen=True)
class BackendOption:
    """A user's choice among a mixer's kernel backends: the config key, the environment variable that overrides it,
    and the choices; its suite's `pin` checks one and sets it for the process, before the kernels are imported."""

    key: str
    env: str
    choices: tuple[str, ...]
    default: str = "auto"


# What `graph_setup` is asked for: graphs about to be recorded as CUDA graphs (what the ops need to be correct
# there), and a training step under CUDA graphs (that, and the op forms fastest there).
CUDA_GRAPHS = "cuda_graphs"
CUDA_GRAPHS_STEP = "cuda_graphs_step"


class SelfTestSuite(Protocol):
    """A mixer's device self-test (kernels/selftest.py runs it): its fast kernels against its fp32 reference, per
    layout (hashable, ordered, with a `key` and a `__str__`) of a config."""

    package: str  # the KernelPackage whose kernels it checks: run where that package is available
    kernels: tuple[str, ...]  # the verdicts' kernel names, in order
    layout_type: type
    versions: tuple[tuple[str, str], ...]  # (label, distribution) in a verdict's cache key after torch
    guard_key: str  # doctor's JSON key for `guard_active()`
    guard_note: str  # doctor's line while the guard is active
    guard_fix: str  # the fix when a guarded kernel fails while its guard is active
    report_key: str  # the bench result's key for `granted()` or `bypass()`
    option: BackendOption | None  # the backend a user may pin (kernels/provision.py pins it), or None

    def layouts(self, config: Any) -> list: ...  # a transformers config -> its layouts (empty: none of this mixer)
    def parse_layout(self, text: str) -> Any: ...  # ValueError when it is not one
    def backend(self, device: Any) -> tuple[str, str]: ...  # (backend, why); the checks run when it is `package`
    def shape(self, kernel: str, layout: Any) -> str: ...  # what of the layout a verdict's cache key holds
    # name -> relative RMS error, on backend `variant` (one of `variants`; None: the suite's only one)
    def check(self, kernel: str, layout: Any, device: Any, variant: str | None = None) -> dict[str, float]: ...
    def guarded(self, kernel: str) -> bool: ...  # whether a guard needs a passing trial before the kernel runs
    def guard_active(self) -> bool: ...
    def grant(self, layout: Any, source: str, variant: str | None = None) -> None: ...  # for that backend only
    def revoke(self, layout: Any, variant: str | None = None) -> None: ...
    def granted(self) -> dict[str, str]: ...  # layout key -> who granted it
    def bypass(self) -> str | None: ...  # the guard off for the whole process (plain transformers): the note
    def prepare(self) -> None: ...  # import the kernel modules (before `seed_tuning` seeds their autotuners)
    def pin(self, choice: str | None, where: str) -> str: ...  # `option`'s choice set (ConfigError naming `where`)
    # (variant, label) of each backend a kernel's verdicts run on; variant None: the suite's only backend
    def variants(self, kernel: str, layout: Any, device: Any) -> list[tuple[str | None, str]]: ...
    def variant_fix(self, variant: str | None) -> str: ...  # what runs when `variant` fails ("": `guard_fix`)
    def configs_key(self, variant: str | None, device: str) -> str: ...  # what else a verdict holds for
    def backend_lines(self, layouts: list) -> list[str]: ...  # the report's lines: what the ops run per layout
    # Its shipped autotuning choices for GPU kind `device` put into its kernels before the self-test: the line said
    def seed_tuning(self, device: str) -> str: ...
    def save_tuning(self, path: Any, device: str) -> int: ...  # this process's choices added to a table: entries


@dataclass(frozen=True)
class MixerSpec:
    """What the package needs to know about one mixer kind (see the module docstring)."""

    kind: str
    layer_types: tuple[str, ...] = ()  # config `layer_types` entries whose mixer this is
    routing: Callable[[], Sequence[Family]] | None = None  # the families, loaded when a model is patched
    flops: Callable[[Any, int, float, float], LayerFlops] | None = None  # (text config, layers, tokens, sum L^2)
    core_kept: bool = False  # whether the FLOP count takes its core as kept by `keep_mixer_cores`
    core_names: tuple[str, str] = ("", "")  # the FLOP breakdown's keys for `core` and `weights`
    activations: Callable[[Any], Activations] | None = None  # (text config) -> per-token elements
    batch_keys: tuple[str, ...] = ()  # keys `metadata` adds to a batch; the model's forward receives them
    dynamic_keys: tuple[str, ...] = ()  # those whose dim 0 varies per batch
    metadata: Callable[[Sequence[int]], dict] | None = None  # document lengths -> batch entries
    size: Callable[[Sequence[int]], int] | None = None  # document lengths -> rows of its dynamic keys
    size_name: str = ""  # one of what `size` counts, for people ("chunk")
    time_share: float = 0.0  # the share of a step's time that scales with `size` rather than with tokens
    core_ops: Callable[[], Iterable[Any]] | None = None  # ops whose outputs a checkpoint may keep
    kernels: tuple[KernelPackage, ...] = ()
    selftest: Callable[[], SelfTestSuite] | None = None  # loaded when kernels/selftest.py runs it
    # (CUDA_GRAPHS | CUDA_GRAPHS_STEP | "option=form" of `graph_forms`) -> the undo of what it set, or None
    graph_setup: Callable[[str], Callable[[], None] | None] | None = None
    graph_forms: dict[str, tuple[str, ...]] = field(default_factory=dict)  # option -> forms in compiled graphs
    profile_patterns: tuple[str, tuple[str, ...]] | None = None  # (profile group, kernel-name substrings)
    path: Callable[[Any], tuple[str, bool]] | None = None  # routed module -> (where its work runs, fast)
    backend: Callable[[str], str] | None = None  # device kind -> the ops backend it runs there, for the report
    extra: dict[str, Any] = field(default_factory=dict)


MIXERS: dict[str, MixerSpec] = {}
# What consumers keep of the registry (a cached set of ops, a table of kernel-name patterns): cleared on a change.
_CACHES: list[Callable[[], None]] = []


def on_change(clear: Callable[[], None]) -> Callable[[], None]:
    """Have `register` and `unregister` call `clear` (a consumer's `cache_clear` of what it derived from `MIXERS`),
    so a mixer registered after the cache was filled is taken. Returns it."""
    _CACHES.append(clear)
    return clear


def _changed() -> None:
    for clear in _CACHES:
        clear()


def register(spec: MixerSpec, *, replace: bool = False, first: bool = False) -> MixerSpec:
    """Add `spec` to `MIXERS` (a second kind of the same name needs `replace=True`). `first`: ahead of the others,
    so its families and layer types win over theirs (a mixer that takes over modules another one routes). Clears
    the consumers' caches (`on_change`). Returns it."""
    if spec.kind in MIXERS and not replace:
        raise ValueError(f"mixer kind {spec.kind!r} is already registered; pass replace=True or unregister it first")
    MIXERS[spec.kind] = spec
    if first:
        rest = {k: v for k, v in MIXERS.items() if k != spec.kind}
        MIXERS.clear()
        MIXERS.update({spec.kind: spec, **rest})
    _changed()
    return spec


def unregister(kind: str) -> MixerSpec | None:
    """Remove a registered kind (tests that register their own), clearing the consumers' caches; returns it, or
    None when absent."""
    spec = MIXERS.pop(kind, None)
    if spec is not None:
        _changed()
    return spec


def for_layer_type(layer_type: str) -> MixerSpec | None:
    """The mixer serving a config's `layer_types` entry, or None."""
    return next((s for s in MIXERS.values() if layer_type in s.layer_types), None)


def families() -> list[tuple[MixerSpec, Family]]:
    """Every (spec, family) pair, in registration order: the first family that matches a module routes it."""
    return [(s, f) for s in MIXERS.values() if s.routing is not None for f in s.routing()]


def route_for(module: Any) -> tuple[MixerSpec, Family] | None:
    """The mixer and family that route `module`, or None."""
    return next(((s, f) for s, f in families() if f.matches(module)), None)


def model_keys(base: Sequence[str] = ()) -> tuple[str, ...]:
    """`base` (batch.MODEL_KEYS) and every mixer's batch keys, each once: what the model's forward receives."""
    return tuple(dict.fromkeys([*base, *(k for s in MIXERS.values() for k in s.batch_keys)]))


def dynamic_keys(base: Sequence[str] = ()) -> tuple[str, ...]:
    """`base` and every mixer's dim-0-dynamic batch keys, each once."""
    return tuple(dict.fromkeys([*base, *(k for s in MIXERS.values() for k in s.dynamic_keys)]))


def metadata(doc_lens: Sequence[int]) -> dict:
    """Every mixer's per-batch metadata for documents of `doc_lens` laid end to end."""
    out: dict = {}
    for s in MIXERS.values():
        if s.metadata is not None:
            out.update(s.metadata(doc_lens))
    return out


def sizes(doc_lens: Sequence[int]) -> dict[str, int]:
    """kind -> the rows of its dynamic metadata for these documents (mixers with a `size` only)."""
    return {s.kind: s.size(doc_lens) for s in MIXERS.values() if s.size is not None}


def size_key(doc_lens: Sequence[int]) -> tuple[int, ...]:
    """Every sized mixer's rows for these documents, in registration order: the sizes a compiled graph of a static
    layout varies in (one CUDA graph per distinct key)."""
    return tuple(s.size(doc_lens) for s in MIXERS.values() if s.size is not None)


def batch_sizes(batch: dict) -> tuple[int, ...]:
    """`size_key` read from a collated batch: the dim-0 size of each sized mixer's first dynamic key."""
    return tuple(
        int(batch[s.dynamic_keys[0]].shape[0])
        for s in MIXERS.values()
        if s.size is not None and s.dynamic_keys and s.dynamic_keys[0] in batch
    )


def kernel_packages() -> dict[str, KernelPackage]:
    """name -> package, over every registered mixer."""
    return {k.name: k for s in MIXERS.values() for k in s.kernels}


def selftests() -> list[SelfTestSuite]:
    """Every registered mixer's self-test suite, in registration order."""
    return [s.selftest() for s in MIXERS.values() if s.selftest is not None]


def graph_forms() -> dict[str, tuple[str, ...]]:
    """option -> forms, over every mixer (the bench's `option=form` mode options)."""
    return {k: v for s in MIXERS.values() for k, v in s.graph_forms.items()}


def graph_setup(what: str) -> Callable[[], None]:
    """Every mixer's process settings for graphs about to be compiled (`what`: CUDA_GRAPHS, CUDA_GRAPHS_STEP or
    an `option=form` of `graph_forms`); returns one undo of them all."""
    option, eq, form = what.partition("=")
    if eq and form not in graph_forms().get(option, ()):
        raise ValueError(f"graph setting {what!r}: {option} takes {'|'.join(graph_forms().get(option, ())) or '-'}")
    undos = [u for s in MIXERS.values() if s.graph_setup is not None for u in [s.graph_setup(what)] if u is not None]

    def undo() -> None:
        for u in reversed(undos):
            u()

    return undo


def profile_groups() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The mixers' (profile group, kernel-name substrings), in registration order."""
    return tuple(s.profile_patterns for s in MIXERS.values() if s.profile_patterns is not None)
