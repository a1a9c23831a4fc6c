"""The benchmark's modes: what a user would run instead (hf-*), and hybridtune's own step (ht-*).

A mode spec is `NAME` or `NAME:key=value,...`. A hybridtune mode is `hybridtune train`'s config (TrainConfig) with
the mode's keys over it, built by train's own functions (runtime/compose.py), so its options are train's keys with
train's values: `ht-loop:cuda_graphs=on,compile_regions=true,keep_mixer_cores=true`. The hf-* modes are plain
transformers + peft (gradient_checkpointing=, pack_layout=, and cuda_graphs= for hf-compile); `ht-*:objective=dpo`
(simpo, orpo) trains on preference pairs beside TRL's DPOTrainer, `trl-dpo` (bench/trl_dpo.py). The mixers' forms in
compiled graphs (`registry.graph_forms`: `conv=traced|stacked|op`) are options of a compiled ht mode, the bench's own. The short spellings of earlier runs
(`cg=on`, `regions=on`, `sac=on`, `gc=off`, `layout=static`, `loss=fused`), in benchmarks/results.jsonl's rows and
scripts, are read as the train keys they stand for (`current_label`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

import yaml

from hybridtune.config import load_config
from hybridtune.errors import ConfigError, did_you_mean
from hybridtune.mixers import registry
from hybridtune.train.objectives import OBJECTIVES


def bench_objectives() -> tuple[str, ...]:
    """The objectives a bench mode may train: every registered one that samples nothing during its step (a step of
    an on-policy objective, grpo's, is benched by grpo_pair.py)."""
    return tuple(name for name, spec in OBJECTIVES.items() if not spec.traits.sampled)


# Train keys a mode may set, with the values the help lists (load_config checks them).
TRAIN_KEYS = {
    "cuda_graphs": ("auto", "on", "off"),
    "compile_regions": ("auto", "true", "false"),
    "keep_mixer_cores": ("auto", "true", "false"),
    "gradient_checkpointing": ("auto", "true", "false"),
    "pack_layout": ("auto", "static", "dynamic"),
    "loss": ("auto", "fused", "plain"),
    "objective": bench_objectives(),  # a preference objective trains on the bench's pairs (pairs.py)
}
FORMS: dict[str, tuple[str, ...]] = {}  # a mixer's option -> its forms in compiled graphs
OPTION_KEYS: dict[str, tuple[str, ...]] = {}  # (listed in `hybridtune bench --help`)


def _fill_options() -> None:
    """FORMS and OPTION_KEYS from the mixers registered now; again whenever the registry changes."""
    FORMS.clear()
    FORMS.update(registry.graph_forms())
    OPTION_KEYS.clear()
    OPTION_KEYS.update({**TRAIN_KEYS, **FORMS})


_fill_options()
registry.on_change(_fill_options)
# Earlier spellings: old key -> (train key, {old value: train value}).
OLD_KEYS = {
    "cg": ("cuda_graphs", {"on": "on", "off": "off"}),
    "regions": ("compile_regions", {"on": "true", "off": "false"}),
    "sac": ("keep_mixer_cores", {"on": "true", "off": "false"}),
    "gc": ("gradient_checkpointing", {"on": "true", "off": "false"}),
    "layout": ("pack_layout", {"static": "static", "dynamic": "dynamic"}),
}
# What every ht mode sets besides its compile: the step of the rows of record (checkpointing on, no CUDA graphs,
# every layer inlined, the cores recomputed, the fused loss); a mode's options change these.
HT_BASE = {
    "gradient_checkpointing": True,
    "cuda_graphs": "off",
    "compile_regions": False,
    "keep_mixer_cores": False,
    "loss": "fused",
}


@dataclass(frozen=True)
class Mode:
    name: str
    what: str
    train: dict | None = None  # ht modes: the train keys over TrainConfig's defaults; None: a baseline (hf) mode
    compile: str = "off"  # hf modes: "off" | "torch" (torch.compile of the model)
    liger: bool = False
    gc: bool = True  # hf modes: gradient checkpointing
    cg: bool = False  # hf-compile: torch.compile mode "reduce-overhead" (CUDA graphs)
    static: bool = False  # hf modes: the static pack layout
    forms: dict = field(default_factory=dict)  # ht modes: mixers' forms in compiled graphs (else train's step's)
    options: dict = field(default_factory=dict)
    trl: bool = False  # TRL's DPOTrainer (bench/trl_dpo.py) on transformers + peft
    padding_free: bool = False  # trl modes: DPOConfig(padding_free=True)
    flatten: bool = False  # hf-pf (vision bench): transformers' DataCollatorWithFlattening (bench/vl_modes.py)

    @property
    def objective(self) -> str:
        """What the mode trains: sft on packed documents, or a preference objective on the bench's pairs."""
        return "dpo" if self.trl else (self.train or {}).get("objective", "sft")

    @property
    def patch(self) -> bool:
        """hybridtune's own step (train's model, mixers patched)."""
        return self.train is not None

    @property
    def cudagraphs(self) -> bool:
        """May record CUDA graphs (the warm-up is stretched for them: `cudagraph_warmup`)."""
        return self.cg if self.train is None else self.train.get("cuda_graphs") != "off"

    @property
    def label(self) -> str:
        if not self.options:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in sorted(self.options.items()))

    def to_dict(self) -> dict:
        return asdict(self) | {"label": self.label, "patch": self.patch}


MODES: dict[str, Mode] = {
    m.name: m
    for m in [
        Mode("hf-eager", "plain transformers + peft, eager, FLA installed"),
        Mode("hf-compile", "plain transformers + peft under torch.compile(model)", compile="torch"),
        Mode(
            "hf-liger",
            "transformers + peft with liger-kernel's Qwen3.5 patches (fused linear cross-entropy)",
            liger=True,
        ),
        Mode(
            "hf-pf",
            "transformers + peft on transformers' padding-free path (DataCollatorWithFlattening: one row, position_ids,"
            " cu_seq_lens); the vision bench's (--vision)",
            flatten=True,
        ),
        Mode("ht-eager", "hybridtune train's step, eager", train={**HT_BASE, "compile": "off"}),
        Mode(
            "ht-loop",
            "hybridtune train's step, decoder loop as one graph, static pack layout, every layer inlined (train's "
            "defaults in one process on a GPU: ht-loop:cuda_graphs=auto,compile_regions=auto,keep_mixer_cores=auto)",
            train={**HT_BASE, "compile": "loop", "pack_layout": "static"},
        ),
        Mode(
            "ht-modules",
            "hybridtune train's step, generated per-class forwards compiled, static pack layout (train under "
            "compile: modules)",
            train={**HT_BASE, "compile": "modules", "pack_layout": "static"},
        ),
        Mode(
            "trl-dpo",
            "TRL's DPOTrainer (objective dpo) on transformers + peft, its own padding, gradient checkpointing",
            trl=True,
        ),
        Mode(
            "trl-dpo-pf",
            "TRL's DPOTrainer with padding_free=True (recorded as not run where TRL does not do it)",
            trl=True,
            padding_free=True,
        ),
    ]
}


def cudagraph_warmup(warmup: int, layouts: int, modes: list[Mode]) -> int:
    """Warm-up steps for a run: CUDA graphs record once per distinct shape (a static layout's chunk count; at
    most one per pack layout), the first call of a shape runs the graph's warm-up, the second records it, so
    with any mode that may record them the warm-up covers every layout twice. The same for every mode of the run:
    the modes' losses then cover the same steps (loss parity is compared step for step)."""
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


def _option(key: str, value: str, spec: str) -> tuple[str, str]:
    """(train key or a mixer's form option, its value as a label writes it) for one `key=value`; old spellings
    mapped."""
    if key in OLD_KEYS:
        new, values = OLD_KEYS[key]
        if value not in values:
            raise ConfigError(f"bench mode option '{key}={value}' in '{spec}': {key}= takes {'|'.join(values)}")
        return new, values[value]
    if key not in OPTION_KEYS:
        allowed = "; ".join(f"{k}={'|'.join(v)}" for k, v in OPTION_KEYS.items())
        raise ConfigError(f"bench mode option '{key}' in '{spec}' is not one of: {allowed}")
    return key, value


def _canonical(key: str, value, spec: str):
    """A train key's value as TrainConfig holds it (YAML words as `hybridtune train --key value` reads them)."""
    try:
        cfg = load_config(None, {key: yaml.safe_load(value)}, warn=False)
    except ConfigError as e:
        raise ConfigError(f"bench mode '{spec}': {e}") from None
    return getattr(cfg, key)


def _word(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def current_label(label: str) -> str:
    """A mode label as this release writes it (an earlier row's `ht-loop:cg=on,regions=on` ->
    `ht-loop:compile_regions=true,cuda_graphs=on`); labels that are no mode spec come back as they are."""
    try:
        return parse_mode(label).label
    except ConfigError:
        return label


def parse_mode(spec: str) -> Mode:
    """`NAME[:key=value,...]` -> Mode; unknown names, keys or values raise a one-line ConfigError."""
    name, _, opts = spec.strip().partition(":")
    if name not in MODES:
        raise ConfigError(f"unknown bench mode '{name}'.{did_you_mean(name, MODES)} Modes: {', '.join(MODES)}.")
    mode = MODES[name]
    options: dict[str, str] = {}
    for item in filter(None, opts.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"bench mode option '{item}' in '{spec}' is not key=value")
        key, value = _option(key, value, spec)
        options[key] = value
    forms = {k: v for k, v in options.items() if k in FORMS}
    for key, value in forms.items():
        if value not in FORMS[key]:
            raise ConfigError(f"bench mode option '{key}={value}' in '{spec}': {key}= takes {'|'.join(FORMS[key])}")
        if not mode.patch or mode.train["compile"] == "off":
            raise ConfigError(f"bench mode '{spec}': {key}= chooses the form of hybridtune's {key} in a compiled mode")
    train = {k: _canonical(k, v, spec) for k, v in options.items() if k not in FORMS}
    if train.get("objective", "sft") not in (benched := bench_objectives()):
        raise ConfigError(f"bench mode '{spec}': objective= takes {'|'.join(benched)} in a bench")
    options = {k: _word(train.get(k, v)) for k, v in options.items()}
    if mode.patch:
        return replace(mode, train={**mode.train, **train}, forms=forms, options=options)
    return _baseline(mode, train, options, spec)


def _baseline(mode: Mode, train: dict, options: dict, spec: str) -> Mode:
    """An hf mode with its options: checkpointing, the pack layout, and CUDA graphs for the compiled one; a trl mode
    takes checkpointing and objective=dpo."""
    if mode.trl:
        if set(train) - {"gradient_checkpointing", "objective"} or train.get("objective", "dpo") != "dpo":
            raise ConfigError(f"bench mode '{spec}': a trl mode takes gradient_checkpointing=true|false (it is dpo)")
        if train.get("gradient_checkpointing") == "auto":
            raise ConfigError(f"bench mode '{spec}': an hf mode takes explicit values (no auto)")
        return replace(mode, options=options, gc=bool(train.get("gradient_checkpointing", True)))
    if train.get("objective", "sft") != "sft":
        raise ConfigError(f"bench mode '{spec}': an hf-* mode trains sft; trl-dpo is the dpo baseline")
    train.pop("objective", None)
    unknown = sorted(set(train) - {"gradient_checkpointing", "pack_layout", "cuda_graphs"})
    if unknown:
        raise ConfigError(f"bench mode '{spec}': {', '.join(unknown)} is a hybridtune mode's (ht-*) key")
    changes: dict = {"options": options}
    if train.get("gradient_checkpointing", True) == "auto" or train.get("pack_layout") == "auto":
        raise ConfigError(f"bench mode '{spec}': an hf mode takes explicit values (no auto)")
    changes["gc"] = bool(train.get("gradient_checkpointing", True))
    changes["static"] = train.get("pack_layout") == "static"
    if "cuda_graphs" in train:
        if mode.compile == "off" and train["cuda_graphs"] != "off":
            raise ConfigError(f"bench mode '{spec}': cuda_graphs (CUDA graphs) needs a compiled mode")
        if train["cuda_graphs"] == "auto":
            raise ConfigError(f"bench mode '{spec}': an hf mode takes explicit values (no auto)")
        changes["cg"] = train["cuda_graphs"] == "on"
    return replace(mode, **changes)
