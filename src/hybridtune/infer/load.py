"""Open what training left behind, or any model, for use: one loader for `generate`, `chat`, `eval` and `export`.

What MODEL may name:

```
OUTPUT_DIR                  a run's output directory: its final/ (else its newest checkpoint, said so)
OUTPUT_DIR/final            the exported full model (transformers) or LoRA adapter (peft)
OUTPUT_DIR/checkpoint-N     a DCP checkpoint: the model rebuilt from the run's recorded config, its weights verified
ADAPTER_DIR                 a peft adapter: on the `base_model/` inside or beside it, else its recorded base
MODEL_DIR, hub id, preset   a base model, as training opens one (models/loading.py)
```

The model comes back as stock transformers (and peft) build it, in eval mode. `patched=True` routes its mixers
through hybridtune's ops before the adapter is applied, as training does (packed evaluation needs it).
"""

from __future__ import annotations

import glob
import json
import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridtune.config import NOT_EMPTY, TrainConfig, load_config
from hybridtune.data.chat import template_names, with_chat_template
from hybridtune.errors import ConfigError, ModelError
from hybridtune.models.hub import resolve_source
from hybridtune.models.loading import LoadedModel, load_model, load_tokenizer, pickle_refused, tokenizer_for
from hybridtune.models.patching import patch_model
from hybridtune.models.presets import PRESETS
from hybridtune.models.trust import refuse_custom_code
from hybridtune.run import checkpoint as ckpt
from hybridtune.run.adapter_base import adapter_base as base_of_adapter
from hybridtune.run.base import base_revision
from hybridtune.run.card import QLORA_TAG
from hybridtune.run.export import FINAL_DIR, INFO_FILE
from hybridtune.run.integrity import meta_problem
from hybridtune.run.merge import read_adapter_config, recorded_quantization, trained_on_nf4
from hybridtune.run.outdir import RUN_FILE
from hybridtune.runtime.adapter_kind import adapter_kind
from hybridtune.runtime.defaults import recorded_values
from hybridtune.runtime.model import assemble
from hybridtune.runtime.quant import roundtrip_targets

logger = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
STEP_NAME = re.compile(r"checkpoint-\d+")  # a checkpoint's directory name


@dataclass
class Opened:
    model: torch.nn.Module  # a transformers model, or peft's PeftModel around one; in eval mode
    tokenizer: object
    kind: str  # "checkpoint", "adapter", "model" (a model directory) or "named" (a preset or hub id)
    name: str  # MODEL as the user gave it
    path: Path | None  # the directory opened (final/, checkpoint-N/, ...); None for a preset or hub id
    run: TrainConfig | None = None  # the config of the run that trained it, when that is known
    step: int | None = None  # the step of a checkpoint, or of a run's final/
    base: str | None = None  # an adapter's base model as opened
    loaded: LoadedModel | None = None  # the base as models.loading loaded it (where it came from, its dtype)


def _json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):  # (nested past the recursion limit)
        return None
    return data if isinstance(data, dict) else None


def run_config(record: dict | None, where: Path) -> TrainConfig | None:
    """A run's config from its record ({"config": ...}, as the run file and checkpoint.json hold it), its `auto`
    learning_rate and sequence_len as the run decided them (runtime/defaults.py)."""
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        return None
    # num_threads is bounded by the machine that runs it and means nothing to a loaded run (a run from a larger
    # machine was refused here as written by another hybridtune version); an empty text a later version refuses
    # stood for the key's default; the checks of what only training reads are left out (training=False).
    config = {k: v for k, v in record["config"].items() if k != "num_threads" and not (k in NOT_EMPTY and v == "")}
    config.update({k: v for k, v in recorded_values(record).items() if config.get(k, "auto") == "auto"})
    try:
        return at_run_cwd(load_config(None, config, warn=False, training=False), record.get("cwd"))
    except ConfigError as e:
        raise ModelError(
            f"{where}: the run's recorded config does not load under this hybridtune version ({e}); "
            "export the model with the version that trained it"
        ) from None


def at_run_cwd(cfg: TrainConfig, cwd) -> TrainConfig:
    """`cfg` with each relative path (base_model, tokenizer, chat_template, data) that names nothing here but
    something under the directory the run ran in (`cwd`, recorded in its run record) made absolute: opened from
    another directory, a run's relative local base_model was taken for a hub id (and looked up on the hub)."""
    if not isinstance(cwd, str) or not cwd:
        return cfg

    def fix(value):
        if not isinstance(value, str) or not value or value in PRESETS or value.startswith("hybridtune:"):
            return value
        p = Path(value).expanduser()
        if p.is_absolute() or p.exists():
            return value
        there = Path(cwd) / p
        return str(there) if there.exists() or glob.glob(str(there)) else value

    cfg.base_model, cfg.tokenizer, cfg.chat_template = fix(cfg.base_model), fix(cfg.tokenizer), fix(cfg.chat_template)
    cfg.dataset = fix(cfg.dataset)
    for ds in [*cfg.datasets, *cfg.test_datasets]:
        ds.path = fix(ds.path)
    return cfg


def _step(record: dict, key: str, where: Path) -> int:
    """`record[key]`, a step number; a ModelError (one line) when a hand edit or damage made it something else."""
    value = record[key]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    shown = json.dumps(value)
    raise ModelError(
        f"{where}: '{key}' is {shown if len(shown) <= 40 else shown[:37] + '...'}, not a step (a whole number "
        ">= 0); the file was edited or damaged: open another checkpoint of the run, or copy this one again"
    )


def _run_of(path: Path) -> tuple[TrainConfig | None, int | None]:
    """The run config and step recorded for a final/ or checkpoint-N/ directory, when it is a run's own."""
    meta = _json(path / ckpt.META_FILE)
    if meta is not None and "step" in meta:  # a checkpoint records its run itself
        step = _step(meta, "step", path / ckpt.META_FILE)
        cfg = run_config(meta.get("run"), path / ckpt.META_FILE)
        if cfg is None:
            cfg = run_config(_json(path.parent / RUN_FILE), path.parent / RUN_FILE)
        return cfg, step
    info = _json(path / INFO_FILE)
    if info is not None and "steps" in info:  # a run's final/: the run file beside it
        step = _step(info, "steps", path / INFO_FILE)
        return run_config(_json(path.parent / RUN_FILE), path.parent / RUN_FILE), step
    return None, None


def resolve_dir(path: Path, say: bool = True) -> Path:
    """An output directory stands for its final/ (else its newest complete checkpoint); anything else for itself."""
    if (path / RUN_FILE).is_file() and not (path / "config.json").is_file():
        if (path / FINAL_DIR).is_dir():
            if say:
                logger.info("%s is a run's output directory: opening its %s/", path, FINAL_DIR)
            return path / FINAL_DIR
        found = ckpt.list_checkpoints(path)
        if found:
            if say:
                logger.info(
                    "%s is a run's output directory without %s/: opening its newest %s", path, FINAL_DIR, found[-1].name
                )
            return found[-1]
        raise ModelError(f"output directory '{path}' holds no {FINAL_DIR}/ and no checkpoint yet; train first")
    return path


def missing_checkpoint(path: Path) -> ModelError | None:
    """The error for `OUTPUT_DIR/checkpoint-N` that is not there (save_total_limit removed it, or the run never got
    to step N), naming what the run's directory holds; None when `path` is not such a name."""
    run_dir = path.parent
    if path.exists() or not STEP_NAME.fullmatch(path.name) or not run_dir.is_dir():
        return None
    kept = [p.name for p in ckpt.list_checkpoints(run_dir)] + (
        [f"{FINAL_DIR}/"] if (run_dir / FINAL_DIR).is_dir() else []
    )
    if not kept and not (run_dir / RUN_FILE).is_file():
        return None
    return ModelError(
        f"'{path}' does not exist (a run keeps only its newest save_total_limit checkpoints); '{run_dir}' holds "
        + (", ".join(kept) if kept else "no checkpoint yet")
        + ": give one of them"
    )


def recorded_run(spec: str) -> TrainConfig | None:
    """The config of the run MODEL `spec` comes from, when it names a run's directory (nothing is loaded)."""
    path = Path(spec).expanduser()
    if (missing := missing_checkpoint(path)) is not None:
        raise missing
    return _run_of(resolve_dir(path, say=False))[0] if path.is_dir() else None


def open_model(spec: str, *, patched: bool = False, dtype: torch.dtype | None = None) -> Opened:
    """Open MODEL `spec` (see the module docstring) on the CPU, in eval mode. Raises ModelError (one line) for what
    cannot be opened, CheckpointError for a damaged checkpoint."""
    path = Path(spec).expanduser()
    if (missing := missing_checkpoint(path)) is not None:
        raise missing
    if not path.is_dir():
        loaded = load_model(spec, dtype=dtype)  # a preset or hub id; its own errors say what is missing
        if patched:
            patch_model(loaded.model)
        return Opened(loaded.model.eval(), loaded.tokenizer, "named", spec, None, loaded=loaded)
    path = resolve_dir(path)
    run, step = _run_of(path)
    if (path / ckpt.META_FILE).is_file() or (path / ckpt.STATE_DIR).is_dir():
        opened = _open_checkpoint(path, run, patched, dtype)
    elif (path / ADAPTER_CONFIG).is_file():
        opened = _open_adapter(path, patched, dtype)
    elif (path / "config.json").is_file():
        loaded = load_model(str(path), dtype=dtype)
        if patched:
            patch_model(loaded.model)
        opened = Opened(loaded.model, loaded.tokenizer, "model", spec, path, loaded=loaded)
    else:
        raise ModelError(
            f"'{path}' holds no model: expected config.json (a model), {ADAPTER_CONFIG} (a LoRA adapter), "
            f"{ckpt.META_FILE} (a checkpoint) or {RUN_FILE} (a run's output directory)"
        )
    opened.name, opened.run, opened.step = spec, run, step if opened.step is None else opened.step
    opened.model.eval()
    return opened


# -- adapters ------------------------------------------------------------------------------------------------


def adapter_base(adapter_dir: Path) -> str:
    """The base model of a peft adapter (run/adapter_base.py): the `base_model/` shipped inside or beside it first
    (a run's export on a preset saves the base there; a copied or archived output directory keeps it beside
    final/), saying so when the recorded base names another; else the recorded `base_model_name_or_path`, a
    relative path read against the adapter directory, a preset or a hub id."""
    config_file = adapter_dir / ADAPTER_CONFIG
    recorded = read_adapter_config(config_file).get("base_model_name_or_path")
    return base_of_adapter(adapter_dir, recorded, config_file)


def _open_adapter(path: Path, patched: bool, dtype: torch.dtype | None) -> Opened:
    from peft import PeftModel

    base_name = adapter_base(path)
    revision = read_adapter_config(path / ADAPTER_CONFIG).get("revision") if not Path(base_name).is_dir() else None
    source = resolve_source(base_name, revision if isinstance(revision, str) else None)
    tok = load_tokenizer(str(path), None) if (path / "tokenizer_config.json").is_file() else tokenizer_for(source)
    loaded = load_model(source, tok, dtype=dtype)
    base_as_trained(loaded.model, path)
    if patched:
        patch_model(loaded.model)
    refuse_custom_code(path)  # (the adapter's own JSON files, as its base's: models/trust.py)
    try:
        model = PeftModel.from_pretrained(loaded.model, str(path))
    except pickle.UnpicklingError as e:  # peft's torch.load(weights_only=True) of an adapter_model.bin
        files = sorted(p.name for p in path.glob("*.bin"))
        raise pickle_refused(f"cannot load the adapter in '{path}'", files, e) from None
    except (OSError, ValueError, KeyError, RuntimeError, TypeError) as e:  # missing or mismatched adapter weights
        raise ModelError(f"cannot load the adapter in '{path}' onto '{base_name}': {e}") from None
    return Opened(model, tok, "adapter", str(path), path, base=base_name, loaded=loaded)


def base_as_trained(model: torch.nn.Module, path: Path) -> bool:
    """The base of the adapter in `path` given the values it trained on: a QLoRA adapter's (its final/hybridtune.json
    records `base_quantization: nf4`) the NF4 round trip of every quantised weight, whatever the base was loaded
    from (a preset's random draw too). An adapter without that record (plain peft files: copied without it, or from
    the hub) goes on the weights as they are, said in one line: a QLoRA adapter there answers otherwise than it
    trained. Returns whether the base went through NF4."""
    if trained_on_nf4(path):
        rounded, kept = roundtrip_targets(model)
        logger.info(
            "adapter %s trained on a 4-bit NF4 base (QLoRA): applied to its base's NF4 round trip (%d weights "
            "rounded, %d held NF4 values already)", path, rounded, kept,
        )  # fmt: skip
        return True
    if recorded_quantization(path) is None:  # (neither final/hybridtune.json nor the card's qlora tag)
        logger.warning(
            "adapter %s has no %s recording whether its base was quantised (nor a '%s' tag in its README.md): "
            "applied to the base's full-precision weights; if it was trained as QLoRA (an NF4 base) its answers "
            "differ from training's: copy the run's %s beside it", path, INFO_FILE, QLORA_TAG, INFO_FILE,
        )  # fmt: skip
    return False


# -- checkpoints ---------------------------------------------------------------------------------------------


def checkpoint_tokenizer(path: Path, run: TrainConfig, source):
    """The tokenizer (and chat template) checkpoint `path` trained with: its own `tokenizer/`, never a file its
    checkpoint.json names. A checkpoint written before checkpoints held one may use its base's tokenizer and a
    template named inside it; a recorded tokenizer directory or template file is refused (anyone can edit the
    record)."""
    own = ckpt.own_tokenizer(path)
    if own is not None:
        return load_tokenizer(str(own), None)
    if run.tokenizer:
        _refuse_recorded(path, "tokenizer directory", run.tokenizer)
    tok = tokenizer_for(source, None)
    if run.chat_template and run.chat_template not in template_names(tok):
        _refuse_recorded(path, "chat template file", run.chat_template)
    return with_chat_template(tok, run.chat_template)


def _refuse_recorded(path: Path, what: str, value: str) -> None:
    raise ModelError(
        f"checkpoint '{path}' holds no tokenizer of its own (written by an older hybridtune) and its "
        f"{ckpt.META_FILE} names a {what} ('{str(value)[:200]}'), which hybridtune does not read from a record; "
        "open the run's final/ instead, or resume the run with this version so that it writes a checkpoint with one"
    )


def _open_checkpoint(path: Path, run: TrainConfig | None, patched: bool, dtype: torch.dtype | None) -> Opened:
    """The model the trainer built for `run` (base, patch, LoRA), with the checkpoint's weights."""
    if run is None and (why := meta_problem(path / ckpt.META_FILE)):  # (unreadable: said as such)
        raise ckpt.CheckpointError(f"checkpoint '{path}' cannot be loaded: {why}")
    if run is None:
        raise ModelError(
            f"checkpoint '{path}' records no run config (checkpoint.json 'run', or {RUN_FILE} in its output "
            "directory), which rebuilding its model needs; open it inside its own output directory"
        )
    # As the trainer builds it (Trainer._setup_data, _setup_model): the base as the run named it (a hub id at the
    # commit the checkpoint trained on; a preset only of the draw it trained on), the run's chat template, fp32
    # weights (a full fine-tune's masters, as the checkpoint holds them; LoRA's base as asked).
    source = resolve_source(run.base_model, base_revision(run, path))
    tok = checkpoint_tokenizer(path, run, source)
    # The model as runtime/model.py's `assemble` builds it for training: a QLoRA run's NF4 base, its LoRA, its vision
    # LoRA or trained tower's dtype, the mixers patched where asked.
    kind = adapter_kind(run)
    held = (dtype or torch.float32) if kind.lora else torch.float32
    built = assemble(run, source, tok, torch.device("cpu"), held, meta=run.load_in_4bit, patched=patched)
    loaded, model = built.loaded, built.model
    state = ckpt.load_weights(path, model, trainable_only=kind.trainable_only)
    if dtype is not None and not kind.lora:
        model.to(dtype)
    logger.info("opened %s: %s (%s) at step %d", path, run.base_model, run.adapter, state["step"])
    base = run.base_model if kind.lora else None
    return Opened(model, tok, "checkpoint", str(path), path, run, int(state["step"]), base, loaded)
