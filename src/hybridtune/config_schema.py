"""The run configuration's keys: `TrainConfig` and `DatasetConfig` (dataclasses with defaults and one sentence of help
per key), the limits their values are checked against (`range_checks`) and their help (`config_help`); the keys of
other fine-tuning tools are the leaf `config_foreign.py`'s. Loading and checking: `hybridtune.config`."""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from hybridtune.config_checks import MAX_INT
from hybridtune.config_grpo import GRPOKeys, grpo_checks
from hybridtune.config_kernels import KernelKeys
from hybridtune.config_objectives import known_objective, unknown_objective
from hybridtune.config_vision import VisionKeys

# Default LoRA targets: attention projections, the linear-attention mixers' projections and the MLP (dense and MoE
# experts' shared MLP). Names that a model lacks are simply not matched; at least one must match.
DEFAULT_LORA_TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj_qkv",
    "in_proj_z",
    "out_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
]

# `lora_target_modules: all-linear` (peft's spelling): every Linear of the text model's decoder layers.
ALL_LINEAR = "all-linear"

BUNDLED_DATASET = "hybridtune:sample/arithmetic.jsonl"
# What `sequence_len: auto` and `learning_rate: auto` are for a preset (the demo's values; runtime/defaults.py decides
# them for a checkpoint), and `sequence_len: auto` where nothing resolves it (data.build.prepare called as a library).
PRESET_SEQUENCE_LEN = 256
PRESET_LEARNING_RATE = 1e-3

MAX_SEED = MAX_INT  # torch.manual_seed takes a 64-bit value (every int key's bound) and the trainer adds the rank
# No real fine-tune uses a learning rate above ~1 (they sit between 1e-6 and 1e-2); tests force a divergence with
# 1e6 on purpose. Past about 3e37 Adam's step size (lr / (1 - beta1)) overflows float32 and torch raises a bare
# RuntimeError, so refuse far below that and far above anything meaningful.
MAX_LEARNING_RATE = 1e10
# torch's intra-op threads beyond the core count only contend for the same cores; a few times the core count
# is room enough for experiments. Tens of thousands exhaust the process's thread limit and the tokenizers'
# thread pool panics (a segfault), so the bound follows the machine rather than a fixed number.
THREADS_PER_CPU = 4


def max_num_threads() -> int:
    """The most CPU threads `num_threads` may ask for on this machine: THREADS_PER_CPU x os.cpu_count()."""
    return THREADS_PER_CPU * (os.cpu_count() or 1)


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: copy.deepcopy(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


@dataclass
class DatasetConfig:
    """One data source. `type: auto` detects the format from the first row's fields."""

    path: str = _f(
        "",
        "a JSONL, JSON, CSV, Parquet or Arrow file, a directory (save_to_disk, or a dataset repo), a glob, "
        "a dataset id org/name (datasets cache; HF_DATASETS_OFFLINE honoured), 'hybridtune:sample/<name>'",
    )
    split: str = _f("train", "directory with splits or dataset id: the split to read")
    name: str | None = _f(None, "directory or dataset id: the config (subset) to read (default: its only one)")
    type: Literal["auto", "text", "alpaca", "chat", "sharegpt", "prompt_completion", "preference"] = _f(
        "auto", "row format (auto: from the first row's fields)"
    )
    field_text: str = _f("text", "text: field holding the document")
    field_instruction: str = _f("instruction", "alpaca: instruction field")
    field_input: str = _f("input", "alpaca: optional input field")
    field_output: str = _f("output", "alpaca: response field")
    field_prompt: str = _f("prompt", "prompt_completion: the prompt (text, or a list of messages)")
    field_completion: str = _f("completion", "prompt_completion: what is trained on (text, or a list of messages)")
    field_chosen: str = _f("chosen", "preference: the preferred reply (text, or a list of messages)")
    field_rejected: str = _f("rejected", "preference: the dispreferred reply (text, or a list of messages)")
    field_messages: str = _f("messages", "chat: list of {role, content}; sharegpt: 'conversations'")
    message_field_role: str = _f("role", "chat: role key in a message ('from' for sharegpt)")
    message_field_content: str = _f("content", "chat: content key in a message ('value' for sharegpt)")
    roles_to_train: list[str] = _f(["assistant"], "chat/sharegpt: roles whose tokens are trained on")


@dataclass
class TrainConfig(GRPOKeys, VisionKeys, KernelKeys):
    # model
    base_model: str = _f(
        "tiny-qwen3_5",
        "a local checkpoint directory, a hub id org/name (at `revision`), or a preset with random weights "
        "(`hybridtune doctor` lists them; NAME@layers=N is its first N decoder layers)",
    )
    revision: str | None = _f(
        None, "hub id only: the branch, tag or commit of base_model to load (default: main), as transformers takes it"
    )
    tokenizer: str | None = _f(None, "tokenizer directory (default: the model's own, or the bundled one for presets)")
    chat_template: str | None = _f(
        None,
        "chat template for chat data: a .jinja/.txt file, or the name of one of the tokenizer's named templates "
        "(default: the tokenizer's own); saved with the final model",
    )
    chat_template_kwargs: dict = _f(
        {}, "variables given to the chat template when it renders the data, such as {enable_thinking: false} (Qwen3.5)"
    )
    # data
    datasets: list[DatasetConfig] = _f([DatasetConfig(path=BUNDLED_DATASET, type="chat")], "list of data sources")
    dataset: str | list[str] | None = _f(
        None, "shorthand for data files, one or a list (--dataset a --dataset b); replaces `datasets`"
    )
    dataset_type: Literal["auto", "text", "alpaca", "chat", "sharegpt", "prompt_completion", "preference"] = _f(
        "auto", "format of `dataset`"
    )
    val_set_size: float = _f(
        0.04, "held-out share (< 1) or count (>= 1) of examples for eval (not used with test_datasets)"
    )
    test_datasets: list[DatasetConfig] = _f(
        [], "data sources evaluated on instead of a val_set_size share of `datasets` (entries as in `datasets`)"
    )
    dataset_num_proc: int = _f(
        0, "processes that tokenise the data (0: auto, one per core for large data); the result is cached"
    )
    min_pixels: int | None = _f(
        None, "vision-language models: the fewest pixels an image is resized to (default: the checkpoint's processor's)"
    )
    max_pixels: int | None = _f(
        None,
        "vision-language models: the most pixels an image is resized to, which bounds its visual tokens (pixels / "
        "(patch x merge)^2); default: the checkpoint's processor's",
    )
    sequence_len: Literal["auto"] | int = _f(
        "auto",
        "tokens per packed bin (and max tokens per example); auto = 256 for a preset, else the least power of two "
        "at or above the 99th percentile of the training examples' lengths, within the model's context",
    )
    sample_packing: bool = _f(True, "pack several examples per bin (off: one example per bin)")
    excess_length_strategy: Literal["truncate", "drop"] = _f("truncate", "examples longer than sequence_len")
    train_on_inputs: bool = _f(False, "also train on prompt/user tokens (default: assistant/response only)")
    # adapter
    adapter: Literal["lora", "qlora", "full"] = _f("full", "full fine-tune (default), lora (peft), qlora (4-bit base)")
    load_in_4bit: bool = _f(False, "QLoRA: the frozen base's linear and expert weights in 4-bit NF4 while loading")

    def __post_init__(self) -> None:  # adapter: qlora is Axolotl's spelling of lora + load_in_4bit
        if self.adapter == "qlora":
            self.adapter, self.load_in_4bit = "lora", True

    lora_r: int = _f(16, "LoRA rank")
    lora_alpha: int = _f(32, "LoRA alpha (scale = alpha / r)")
    lora_dropout: float = _f(0.0, "LoRA dropout")
    lora_target_modules: list[str] = _f(
        list(DEFAULT_LORA_TARGETS),
        "module names that get LoRA, or all-linear (every Linear of the text model's decoder layers, as peft's)",
    )
    lora_target_parameters: list[str] = _f(
        [],
        "parameters that get LoRA through peft's target_parameters (a parameter name's end): the routed experts' "
        "weights such as [gate_up_proj, down_proj], as grouped GEMMs; needs lora_dropout: 0",
    )
    # optimisation
    micro_batch_size: int = _f(1, "packed bins per forward (laid end to end in one [1, T] row)")
    gradient_accumulation_steps: int = _f(1, "micro-batches per optimizer step")
    num_epochs: float = _f(2.0, "passes over the training data (ignored when max_steps > 0)")
    max_steps: int = _f(
        -1, "optimizer steps to run (-1: from num_epochs; 0: only evaluate and export the starting model)"
    )
    learning_rate: Literal["auto"] | float = _f(
        "auto",
        "peak learning rate; auto = 2e-4 for LoRA and 1e-5 for a full fine-tune of a checkpoint, 1e-3 for a preset",
    )
    lr_scheduler: Literal["cosine", "linear", "constant"] = _f("cosine", "decay after warmup")
    warmup_steps: int = _f(10, "linear warmup steps")
    warmup_ratio: float = _f(
        0.0, "linear warmup as a share of the run's steps, in [0, 1), instead of warmup_steps (0: warmup_steps)"
    )
    weight_decay: float = _f(0.0, "AdamW weight decay")
    optim: Literal["adamw", "adamw_8bit", "adamw_bf16_sr", "adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit"] = _f(
        "adamw", "adamw (torch's), adamw_8bit, adamw_bf16_sr (torchao's); transformers' names read as these (CONFIG.md)"
    )
    max_grad_norm: float = _f(1.0, "gradient clipping (0: off)")
    bf16: Literal["auto"] | bool = _f("auto", "bf16 autocast: auto = on a GPU that supports it, off on CPU")
    gradient_checkpointing: Literal["auto"] | bool = _f(
        "auto",
        "recompute activations in backward to save memory; auto = on when the step's GPU memory estimate without it "
        "exceeds the free memory, or when a first step without it runs out",
    )
    pack_layout: Literal["auto", "static", "dynamic"] = _f(
        "auto",
        "static = every batch filled to one shape with filler documents (fewer recompiles), dynamic = no filler, "
        "auto = static under a compiled run when the filler is cheap and the model has no router loss",
    )
    objective: str = _f(  # one of config_objectives' registry (the built-ins, and any registered objective)
        "sft",
        "what training minimises: sft = next-token cross-entropy on the trained tokens; dpo, simpo, orpo = "
        "preference tuning on prompt/chosen/rejected pairs; grpo = RL on rewarded samples",
    )
    beta: float = _f(
        0.1, "dpo/simpo/orpo: the preference term's strength (TRL's beta); grpo: KL coefficient (0 = none)"
    )
    loss_type: Literal["auto", "sigmoid", "ipo", "hinge", "robust", "grpo", "dr_grpo", "dapo"] = _f(
        "auto", "dpo: sigmoid, ipo, hinge or robust (auto: sigmoid); grpo: grpo, dr_grpo or dapo (auto: dapo)"
    )
    label_smoothing: float = _f(0.0, "dpo/simpo: the assumed share of flipped preference labels (conservative DPO)")
    rpo_alpha: float | None = _f(None, "dpo/simpo: weight of an added NLL term on the chosen replies (TRL's rpo_alpha)")
    simpo_gamma: float = _f(0.5, "simpo: the target reward margin")
    loss: Literal["auto", "fused", "plain"] = _f(
        "auto",
        "cross-entropy: fused = chunked against lm_head without [tokens, vocab] logits, plain = transformers' own, "
        "auto = fused where the model's head allows it",
    )
    # evaluation, logging, checkpoints
    eval_steps: int = _f(100, "evaluate every N steps (0: only at the end)")
    eval_max_examples: int = _f(200, "cap on held-out examples per eval")
    eval_samples: int = _f(
        0, "greedy generations logged at each eval, from the prompts of the first held-out chat/alpaca examples"
    )
    eval_max_new_tokens: int = _f(64, "eval_samples: the most tokens each generation adds")
    logging_steps: int = _f(10, "log every N steps (the logged loss is the mean over the steps since the last log)")
    report_to: Literal["none", "tensorboard", "wandb"] = _f(
        "none", "also send the metrics to TensorBoard (output_dir/runs/<run_name>) or Weights & Biases"
    )
    run_name: str | None = _f(None, "the run's name in TensorBoard / W&B (default: output_dir's name)")
    save_steps: int = _f(0, "checkpoint every N steps (0: only at the end)")
    save_total_limit: int = _f(2, "checkpoints kept (oldest removed first)")
    profile_steps: int = _f(
        0,
        "profile N optimizer steps with torch.profiler and write the breakdown to profile-<first>-<last>.json (0: off)",
    )
    output_dir: str = _f("outputs/run", "where checkpoints, the final model and metrics.jsonl go")
    overwrite: bool = _f(False, "allow an output_dir that already holds a different run")
    resume_from_checkpoint: str | None = _f(None, "checkpoint directory, or 'latest' for the newest in output_dir")
    seed: int = _f(42, "random seed (data order, init of LoRA, dropout)")
    # speed
    kernels: Literal["auto", "check", "off"] = _f(
        "auto", "fast kernels: auto = install missing ones (pinned wheels, GPU only), check = report only, off = skip"
    )
    compile: Literal["auto", "off", "loop", "modules"] = _f(
        "auto",
        "torch.compile strategy: loop = the whole decoder loop as one graph, modules = per-class forwards, "
        "auto = loop on a GPU and off on the CPU (where inductor's C++ build is slow)",
    )
    cuda_graphs: Literal["auto", "on", "off"] = _f(
        "auto",
        "replay the compiled loop's kernels as CUDA graphs (torch.compile mode reduce-overhead); auto = on for one "
        "process running compile: loop on a GPU over a static pack_layout",
    )
    compile_regions: Literal["auto"] | bool = _f(
        "auto",
        "compile: loop traces each distinct decoder layer once and reuses it for the identical ones: the same step, "
        "a shorter first one; auto = on for the loop in one process, off under torchrun",
    )
    keep_mixer_cores: Literal["auto"] | bool = _f(
        "auto",
        "under checkpointing, keep the mixers' core outputs (true: faster, more memory) or recompute them in the "
        "backward (false); auto = keep them when the memory estimate fits",
    )
    compile_overrides: list[str] = _f(
        [], "per-class plan overrides for compile: modules, as Class=compile|fullgraph|eager|off (see doctor)"
    )
    require_fast_path: bool = _f(False, "refuse to train when a mixer would run on a slow fallback")
    device: Literal["auto", "cpu", "cuda"] = _f("auto", "where to train")
    distributed: Literal["auto", "ddp", "fsdp"] = _f(
        "auto",
        "engine under torchrun or --nproc N: ddp = the whole model on every rank, fsdp = FSDP2 (see fsdp_units), "
        "auto = ddp for LoRA and fsdp for a full fine-tune",
    )
    fsdp_units: str = _f(
        "auto",
        "FSDP2's unit: layer (least memory), group:K (K consecutive layers), model (what compile: loop needs), "
        "auto (model under the loop if it leaves room for activations, else the largest group that fits)",
    )
    num_threads: int = _f(
        0, "CPU threads for torch (0 = auto: one thread for small models on the CPU, else torch's default)"
    )

    def resolved_datasets(self) -> list[DatasetConfig]:
        if self.dataset:
            paths = [self.dataset] if isinstance(self.dataset, str) else self.dataset
            return [DatasetConfig(path=p, type=self.dataset_type) for p in paths]
        return self.datasets


def range_checks(cfg: TrainConfig) -> list[tuple[bool, str, Any, str]]:
    """(ok, key, value, what it must be) for each bound that a key's type cannot express."""
    return [
        (cfg.sequence_len == "auto" or cfg.sequence_len >= 2, "sequence_len", cfg.sequence_len, "must be at least 2"),
        (cfg.micro_batch_size >= 1, "micro_batch_size", cfg.micro_batch_size, "must be at least 1"),
        (
            cfg.gradient_accumulation_steps >= 1,
            "gradient_accumulation_steps",
            cfg.gradient_accumulation_steps,
            "must be at least 1",
        ),
        (cfg.lora_r >= 1, "lora_r", cfg.lora_r, "must be at least 1"),
        (not cfg.load_in_4bit or cfg.adapter == "lora", "load_in_4bit", True, "needs adapter: lora (a frozen base)"),
        (0.0 <= cfg.lora_dropout < 1.0, "lora_dropout", cfg.lora_dropout, "must be in [0, 1)"),
        (cfg.learning_rate == "auto" or cfg.learning_rate > 0, "learning_rate", cfg.learning_rate, "must be positive"),
        (
            cfg.learning_rate == "auto" or cfg.learning_rate <= MAX_LEARNING_RATE,
            "learning_rate",
            cfg.learning_rate,
            f"must be at most {MAX_LEARNING_RATE:g} (fine-tunes use 1e-6 to 1e-2; far larger overflows the "
            "optimizer); use e.g. 1e-4",
        ),
        (cfg.val_set_size >= 0, "val_set_size", cfg.val_set_size, "must be >= 0"),
        (
            cfg.max_steps >= -1,
            "max_steps",
            cfg.max_steps,
            "must be -1 (from num_epochs), 0 (only evaluate and export) or more",
        ),
        (cfg.num_epochs > 0, "num_epochs", cfg.num_epochs, "must be positive"),
        (cfg.warmup_steps >= 0, "warmup_steps", cfg.warmup_steps, "must be >= 0"),
        (0 <= cfg.warmup_ratio < 1, "warmup_ratio", cfg.warmup_ratio, "must be in [0, 1) (a share of the steps)"),
        (
            cfg.warmup_ratio == 0 or cfg.warmup_steps == TrainConfig.warmup_steps,
            "warmup_steps",
            cfg.warmup_steps,
            "is set beside warmup_ratio; the two are exclusive (steps, or a share of the run): give one",
        ),
        (
            ALL_LINEAR not in cfg.lora_target_modules or cfg.lora_target_modules == [ALL_LINEAR],
            "lora_target_modules",
            cfg.lora_target_modules,
            f"names {ALL_LINEAR} beside other modules; give {ALL_LINEAR} alone or a list of names",
        ),
        (cfg.weight_decay >= 0, "weight_decay", cfg.weight_decay, "must be >= 0"),
        (cfg.max_grad_norm >= 0, "max_grad_norm", cfg.max_grad_norm, "must be >= 0"),
        (cfg.lora_alpha >= 1, "lora_alpha", cfg.lora_alpha, "must be at least 1 (the LoRA scale is alpha / r)"),
        (cfg.logging_steps >= 1, "logging_steps", cfg.logging_steps, "must be at least 1"),
        (
            bool(re.fullmatch(r"auto|layer|model|group:[1-9][0-9]*", str(cfg.fsdp_units))),
            "fsdp_units",
            cfg.fsdp_units,
            "must be auto, layer, model or group:K (K consecutive decoder layers per unit, K >= 1); e.g. group:4",
        ),
        (cfg.eval_steps >= 0, "eval_steps", cfg.eval_steps, "must be 0 (only at the end) or more"),
        (cfg.save_steps >= 0, "save_steps", cfg.save_steps, "must be 0 (only at the end) or more"),
        (
            cfg.eval_max_examples >= 1,
            "eval_max_examples",
            cfg.eval_max_examples,
            "must be at least 1 (to evaluate nothing, set val_set_size: 0)",
        ),
        (cfg.num_threads >= 0, "num_threads", cfg.num_threads, "must be 0 (auto) or more"),
        (cfg.min_pixels is None or cfg.min_pixels >= 1, "min_pixels", cfg.min_pixels, "must be at least 1"),
        (
            cfg.max_pixels is None or cfg.max_pixels >= max(1, cfg.min_pixels or 1),
            "max_pixels",
            cfg.max_pixels,
            "must be at least 1 and at least min_pixels",
        ),
        (
            cfg.num_threads <= max_num_threads(),
            "num_threads",
            cfg.num_threads,
            f"must be at most {max_num_threads()} ({THREADS_PER_CPU} x the {os.cpu_count() or 1} CPUs of this "
            "machine; more threads only contend for the same cores); use 0 for auto",
        ),
        (0 <= cfg.seed <= MAX_SEED, "seed", cfg.seed, f"must be between 0 and 2**63 - 1 ({MAX_SEED})"),
        (cfg.save_total_limit >= 1, "save_total_limit", cfg.save_total_limit, "must be at least 1"),
        (cfg.profile_steps >= 0, "profile_steps", cfg.profile_steps, "must be 0 (off) or more"),
        (cfg.eval_samples >= 0, "eval_samples", cfg.eval_samples, "must be 0 (off) or more"),
        (cfg.eval_max_new_tokens >= 1, "eval_max_new_tokens", cfg.eval_max_new_tokens, "must be at least 1"),
        (known_objective(cfg.objective), "objective", cfg.objective, unknown_objective(cfg.objective)),
        (cfg.beta > 0 or (cfg.beta == 0 and cfg.objective == "grpo"), "beta", cfg.beta, "must be > 0 (grpo: >= 0)"),
        *grpo_checks(cfg),
        (0 <= cfg.label_smoothing < 0.5, "label_smoothing", cfg.label_smoothing, "must be in [0, 0.5)"),
        (cfg.rpo_alpha is None or cfg.rpo_alpha >= 0, "rpo_alpha", cfg.rpo_alpha, "must be null (off) or >= 0"),
        (cfg.simpo_gamma >= 0, "simpo_gamma", cfg.simpo_gamma, "must be >= 0"),
    ]


def type_name(tp: Any) -> str:
    """A key's annotation as people read it: `list of str`, `'lora' | 'full'`, `int | null`."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def config_help() -> str:
    """Every key with its type, default and meaning, for `hybridtune train --help`."""
    rows = []
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "datasets":
            default = "[bundled arithmetic chats]"
        rows.append(f"  --{f.name} ({type_name(hints[f.name])}, default {default!r})\n      {f.metadata['help']}")
    ds_rows = []
    ds_hints = typing.get_type_hints(DatasetConfig)
    for f in dataclasses.fields(DatasetConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        ds_rows.append(f"    {f.name} ({type_name(ds_hints[f.name])}, default {default!r}): {f.metadata['help']}")
    return (
        "config keys (YAML file or --key value):\n"
        + "\n".join(rows)
        + "\n\n  each entry of `datasets` and `test_datasets`:\n"
        + "\n".join(ds_rows)
    )
