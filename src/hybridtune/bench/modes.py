"""The benchmark's modes: what a user would run instead, and hybridtune's own paths.

A mode spec is `NAME` or `NAME:key=value,...` (for example `ht-loop:gc=off`), so one run can hold a
mode at identical settings beside the same mode at its best settings.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from hybridtune.errors import ConfigError, did_you_mean


@dataclass(frozen=True)
class Mode:
    name: str
    what: str
    patch: bool  # route the GDN mixers through hybridtune's ops (patch_model)
    compile: str  # "off" | "torch" (plain torch.compile of the model) | "loop" | "modules"
    loss: str  # "plain" (transformers' loss over [T, vocab] logits) | "fused" (hybridtune.ops.loss)
    liger: bool = False
    gc: bool = True  # gradient checkpointing
    cudagraphs: bool = False  # torch.compile mode "reduce-overhead" (CUDA graphs) for the compiled modes
    input_require_grads: bool = False  # peft + checkpointing as users run it (`enable_input_require_grads`)
    static: bool = False  # static pack layout (filler documents: one T and N; see hybridtune.data.collator)
    # The GDN conv in compiled regions: "traced"/"stacked" (inductor-fused) or "op" (FLA's kernel). Under CUDA graphs
    # the default is "op": its launch cost is gone there (measured faster than "traced": benchmarks/NOTES.md).
    conv: str = "traced"
    regional: bool = False  # the loop compiles each distinct decoder layer once (compiler/regions.py)
    keep_cores: bool = False  # checkpointed layers keep their mixers' cores, not recomputed (compiler/recompute.py)
    options: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))

    def to_dict(self) -> dict:
        return asdict(self) | {"label": self.label}


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode(
            "hf-eager",
            "plain transformers + peft, eager, FLA installed",
            patch=False,
            compile="off",
            loss="plain",
            input_require_grads=True,
        ),
        Mode(
            "hf-compile",
            "plain transformers + peft under torch.compile(model)",
            patch=False,
            compile="torch",
            loss="plain",
            input_require_grads=True,
        ),
        Mode(
            "hf-liger",
            "transformers + peft with liger-kernel's Qwen3.5 patches (fused linear cross-entropy)",
            patch=False,
            compile="off",
            loss="plain",
            liger=True,
            input_require_grads=True,
        ),
        Mode("ht-eager", "hybridtune ops + fused loss, eager", patch=True, compile="off", loss="fused"),
        Mode(
            "ht-loop",
            "hybridtune ops + fused loss, decoder loop as one graph, static pack layout, every layer inlined (`hybridtune "
            "train`'s defaults in one process on a GPU: ht-loop:cg=on,regions=on)",
            patch=True,
            compile="loop",
            loss="fused",
            static=True,
        ),
        Mode(
            "ht-modules",
            "hybridtune ops + fused loss, generated per-class forwards compiled, static pack layout (as `hybridtune "
            "train` under compile: modules)",
            patch=True,
            compile="modules",
            loss="fused",
            static=True,
        ),
    ]
}

OPTION_KEYS = {
    "gc": ("on", "off"),
    "loss": ("plain", "fused"),
    "cg": ("on", "off"),
    "layout": ("static", "dynamic"),
    "conv": ("traced", "stacked", "op"),
    "regions": ("on", "off"),
    "sac": ("on", "off"),
}


def cudagraph_warmup(warmup: int, layouts: int, modes: list[Mode]) -> int:
    """Warm-up steps for a run: CUDA graphs record once per distinct shape (a static layout's chunk count; at
    most one per pack layout), the first call of a shape runs the graph's warm-up, the second records it, so
    with any `cg=on` mode the warm-up covers every layout twice. The same for every mode of the run: the
    modes' losses then cover the same steps (loss parity is compared step for step)."""
    return max(warmup, 2 * layouts) if any(m.cudagraphs for m in modes) else warmup


def split_modes(text: str) -> list[str]:
    """`--modes` text -> mode specs. Commas separate modes and also a mode's options, so an item that is a bare
    `key=value` continues the mode before it: "ht-loop:cg=on,conv=op,hf-eager" -> ["ht-loop:cg=on,conv=op", "hf-eager"]."""
    specs: list[str] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if "=" in item and ":" not in item and specs:
            specs[-1] += "," + item
        else:
            specs.append(item)
    return specs


def parse_mode(spec: str) -> Mode:
    """`NAME[:key=value,...]` -> Mode; unknown names or keys raise a one-line ConfigError."""
    name, _, opts = spec.strip().partition(":")
    if name not in MODES:
        raise ConfigError(f"unknown bench mode '{name}'.{did_you_mean(name, MODES)} Modes: {', '.join(MODES)}.")
    mode = MODES[name]
    options: dict[str, str] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if key not in OPTION_KEYS or not eq or value not in OPTION_KEYS[key]:
            allowed = "; ".join(f"{k}={'|'.join(v)}" for k, v in OPTION_KEYS.items())
            raise ConfigError(f"bench mode option '{item}' in '{spec}' is not one of: {allowed}")
        options[key] = value
    changes: dict = {"options": options}
    if "gc" in options:
        changes["gc"] = options["gc"] == "on"
    if "loss" in options:
        changes["loss"] = options["loss"]
    if "layout" in options:
        changes["static"] = options["layout"] == "static"
    if "conv" in options:
        if not mode.patch or mode.compile == "off":
            raise ConfigError(f"bench mode '{spec}': conv= chooses the form of hybridtune's conv in a compiled mode")
        changes["conv"] = options["conv"]
    if "regions" in options:
        if mode.compile != "loop":
            raise ConfigError(
                f"bench mode '{spec}': regions= chooses how the compiled loop (ht-loop) traces its layers"
            )
        changes["regional"] = options["regions"] == "on"
    if "sac" in options:
        if mode.compile != "loop":
            raise ConfigError(f"bench mode '{spec}': sac= chooses what the compiled loop (ht-loop) recomputes")
        changes["keep_cores"] = options["sac"] == "on"
    if "cg" in options:
        if mode.compile == "off" and options["cg"] == "on":
            raise ConfigError(f"bench mode '{spec}': cg=on (CUDA graphs) needs a compiled mode")
        changes["cudagraphs"] = options["cg"] == "on"
        if changes["cudagraphs"] and mode.patch and "conv" not in options:
            changes["conv"] = "op"
    return replace(mode, **changes)
