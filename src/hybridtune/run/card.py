"""The model card of a final export (`final/README.md`): YAML front matter the Hugging Face hub reads (base model as
the user named it, library, tags), then what was trained, from what, on which data, with which settings, the final
metrics and the hybridtune version. A preset's weights are random: its card says so before anything else."""

from __future__ import annotations

import json
from pathlib import Path

from hybridtune import __version__
from hybridtune.config import TrainConfig
from hybridtune.models.anatomy import unwrap
from hybridtune.models.loading import LoadedModel
from hybridtune.run import serving
from hybridtune.runtime.adapter_kind import adapter_kind

SETTINGS = (
    "sequence_len",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler",
    "warmup_steps",
    "weight_decay",
    "max_grad_norm",
    "seed",
)
LORA_SETTINGS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters")
QLORA_TAG = "qlora"  # the card's tag of an adapter trained on an NF4 base: a record that travels with it to the hub
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py MaxLoRARanks: --max-lora-rank
RANDOM_WARNING = (
    "> **WARNING: this model was trained from the preset `{name}`, whose weights are RANDOM** (a seeded random\n"
    "> initialisation for demos, tests and benchmarks, not a trained model). It has learnt only what this run taught\n"
    "> it; do not use it as a language model."
)


def last_metrics(out_dir: Path, steps: int | None = None) -> tuple[dict | None, dict | None]:
    """(the last train row, the last eval row) of the run's metrics.jsonl up to step `steps` (a checkpoint exported
    later: its own step's); None where there is none."""
    train = evaluation = None
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return None, None
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if not isinstance(row, dict) or (steps is not None and row.get("step", 0) > steps):
            continue
        if row.get("type") == "train":
            train = row
        elif row.get("type") == "eval":
            evaluation = row
    return train, evaluation


def _yaml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string is a valid YAML scalar


def front_matter(cfg: TrainConfig, loaded: LoadedModel) -> str:
    lines = ["---"]
    if not loaded.random_init:
        lines.append(f"base_model: {_yaml_str(loaded.name)}")
    lines.append(f"library_name: {'peft' if adapter_kind(cfg).lora else 'transformers'}")
    lines.append("pipeline_tag: text-generation")
    tags = ["hybridtune", "lora" if adapter_kind(cfg).lora else "full-fine-tune"]
    model_type = getattr(getattr(loaded.model, "config", None), "model_type", None)
    if model_type:
        tags.append(model_type)
    if loaded.random_init:
        tags.append("random-weights")
    if adapter_kind(cfg).nf4_base:  # read back by merge (run/merge.py) when hybridtune.json is gone
        tags.append(QLORA_TAG)
    lines += ["tags:", *(f"- {_yaml_str(t)}" for t in tags), "---"]
    return "\n".join(lines)


def model_card(cfg: TrainConfig, loaded: LoadedModel, steps: int, out_dir: Path) -> str:
    """The card's Markdown text for a run of `cfg` from `loaded` that ran `steps` optimizer steps and logged into
    `out_dir`/metrics.jsonl."""
    kind = "A LoRA adapter" if adapter_kind(cfg).lora else "A full fine-tune"
    base = f"`{loaded.name}`" + (f" (commit `{loaded.revision}`)" if loaded.revision else "")
    parts = [front_matter(cfg, loaded), "", f"# {Path(out_dir).resolve().name}", ""]
    if loaded.random_init:
        parts += [RANDOM_WARNING.format(name=loaded.name), ""]
    parts += [f"{kind} of {base}, trained with hybridtune {__version__} for {steps} steps.", ""]
    parts += ["## Data", ""]
    for ds in cfg.resolved_datasets():
        parts.append(f"- `{ds.path}` ({ds.type})")
    parts.append(f"- held out for evaluation: {cfg.val_set_size:g}")
    parts += ["", "## Settings", "", "| key | value |", "| --- | --- |", f"| adapter | {cfg.adapter} |"]
    keys = SETTINGS + (LORA_SETTINGS if adapter_kind(cfg).lora else ())
    parts += [f"| {k} | {_cell(getattr(cfg, k))} |" for k in keys]
    train, evaluation = last_metrics(out_dir, steps)
    parts += ["", "## Final metrics", ""]
    if train is None and evaluation is None:
        parts.append("None logged.")
    if train is not None:
        parts.append(f"- train loss {train['loss']:.4f} at step {train['step']}")
    if evaluation is not None:
        parts.append(
            f"- eval loss {evaluation['eval_loss']:.4f}, exact match {evaluation.get('exact_match', float('nan')):.3f} "
            f"at step {evaluation['step']} ({evaluation.get('eval_examples', '?')} held-out examples)"
        )
    parts += ["", "## Use", "", "```python", *_usage(cfg, loaded), "```", ""]
    parts += ["## Serve", "", *_serving(cfg, loaded), ""]
    return "\n".join(parts)


def _cell(value) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(str(v) for v in value) or "(none)"
    return str(value)


def _base_line(cls: str, loaded: LoadedModel) -> str:
    """The line that loads the adapter's base: as named (a hub id at the commit trained on), or for a preset (no
    model anywhere but the weights the run saved) its base_model/ beside final/."""
    if loaded.random_init:
        return f'base = {cls}.from_pretrained("path/to/base_model")  # saved beside final/ (a preset\'s random weights)'
    revision = f", revision={json.dumps(loaded.revision)}" if loaded.revision else ""
    return f"base = {cls}.from_pretrained({json.dumps(loaded.name)}{revision})"


def _usage(cfg: TrainConfig, loaded: LoadedModel) -> list[str]:
    """How to load it: in the original class (a vision-language checkpoint's adapter follows that tree)."""
    cls = type(unwrap(loaded.model)).__name__
    if adapter_kind(cfg).lora:
        return [
            "from peft import PeftModel",
            f"from transformers import {cls}",
            "",
            _base_line(cls, loaded),
            'model = PeftModel.from_pretrained(base, "path/to/final")',
        ]
    return [f"from transformers import {cls}", "", f'model = {cls}.from_pretrained("path/to/final")']


def _serving(cfg: TrainConfig, loaded: LoadedModel) -> list[str]:
    """How to serve it: a full fine-tune as it is; an adapter with vLLM's LoRA flags on its base, or merged (any
    engine, adapters or not); the packed groups completed with zero LoRA and what an engine leaves out
    (run/serving.py)."""
    if not adapter_kind(cfg).lora:
        return ["The model is whole: serve it as the released checkpoint is, e.g. `vllm serve path/to/final`."]
    base = "path/to/base_model" if loaded.random_init else loaded.name
    revision = f" --revision {loaded.revision}" if loaded.revision else ""
    rank = next((r for r in VLLM_LORA_RANKS if r >= cfg.lora_r), None)
    if rank is None:
        lines = [f"vLLM takes LoRA ranks up to {VLLM_LORA_RANKS[-1]} (this one is {cfg.lora_r}): serve it merged."]
    else:
        flags = f"--enable-lora --max-lora-rank {rank} --lora-modules adapter=path/to/final"
        lines = ["vLLM applies the adapter to its base (requests name the model `adapter`):", ""]
        lines += ["```bash", f"vllm serve {base}{revision} {flags}", "```"]
    lines += [
        "",
        "For an engine that takes no adapters, or one that leaves part of this adapter out (below), serve the",
        "merged model (the base with the LoRA folded in, in the base's dtype and class):",
        "`hybridtune merge path/to/run merged` (from a checkpoint: `hybridtune export --merged CHECKPOINT OUT`, which",
        "writes OUT/merged), then serve it as the released checkpoint is, e.g. `vllm serve merged`.",
    ]
    served = serving.plan(loaded.model)
    if served.added:
        lines += ["", f"`{'`, `'.join(served.added)}` carry zero LoRA (the model is unchanged): engines that stack "
                  "packed projections (q/k/v, gate/up, the linear-attention in_proj) then find every member of each group this "
                  "adapter touches."]  # fmt: skip
    if served.notes:
        lines += ["", *(f"- {note}" for note in served.notes)]
    return lines
