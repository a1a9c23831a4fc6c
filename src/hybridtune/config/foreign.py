"""The keys of other fine-tuning tools (Axolotl, LLaMA-Factory, TRL / transformers' TrainingArguments): each with
hybridtune's key of the same meaning or what to do instead (`FOREIGN_KEYS`, `FOREIGN_DATASET_KEYS`, `FOREIGN_VALUES`),
and the values that change nothing here (`noop`): a config of another tool that holds them trains after one warning
line listing them, while a key that would change training stays refused; and hybridtune's own renamed keys
(`RENAMED_KEYS`). parse.py reads it."""

from __future__ import annotations

from typing import Any

from hybridtune.errors import ConfigError

# Keys of other fine-tuning tools (Axolotl, LLaMA-Factory, TRL / transformers' TrainingArguments) -> hybridtune's key
# of the same meaning and values, or what to do instead, in words.
_QUANTIZED = "hybridtune's quantized base is NF4 (torchao; bf16 compute): set load_in_4bit: true, no bnb_* keys"
_ENGINE = "hybridtune shards with its own DDP/FSDP2: run with --nproc N and set distributed (ddp | fsdp); remove it"
_KERNELS = "hybridtune picks its attention and linear-attention kernels itself (see the kernels key); remove it"
_UPLOAD = "hybridtune does not upload: the run's final/ (or an exported checkpoint) is the model to upload; remove it"
_WANDB = "set report_to: wandb; W&B's own variables (WANDB_PROJECT, WANDB_ENTITY) name the project"
_STEPS = "hybridtune counts in steps: set eval_steps / save_steps (0: only at the end)"
FOREIGN_KEYS: dict[str, str] = {
    "lr": "learning_rate",
    "num_train_epochs": "num_epochs",
    "epochs": "num_epochs",
    "per_device_train_batch_size": "micro_batch_size",
    "lora_rank": "lora_r",
    "image_min_pixels": "min_pixels",
    "image_max_pixels": "max_pixels",
    "lora_target": "write lora_target_modules: a list of module names, or all-linear (LLaMA-Factory's all)",
    "lr_scheduler_type": "lr_scheduler",
    "model_name_or_path": "base_model",
    "cutoff_len": "sequence_len",
    "max_seq_length": "sequence_len",
    "max_length": "sequence_len",
    "packing": "sample_packing",
    "val_size": "val_set_size",
    "preprocessing_num_workers": "dataset_num_proc",
    "overwrite_output_dir": "overwrite",
    "dataset_text_field": "set field_text in the entry of datasets",
    "finetuning_type": "set adapter: lora or adapter: full",
    "use_peft": "set adapter: lora",
    "lora_target_linear": "write lora_target_modules: all-linear",
    "load_in_8bit": _QUANTIZED,
    "quantization_bit": _QUANTIZED,
    "bnb_4bit_quant_type": _QUANTIZED,
    "bnb_4bit_compute_dtype": _QUANTIZED,
    "optimizer": "optim",
    "deepspeed": _ENGINE,
    "fsdp": _ENGINE,
    "fsdp_config": _ENGINE,
    "flash_attention": _KERNELS,
    "sdp_attention": _KERNELS,
    "flash_attn": _KERNELS,
    "attn_implementation": _KERNELS,
    "fp16": "hybridtune trains in bf16 autocast or fp32 (the bf16 key); remove it",
    "tf32": "hybridtune computes in bf16 autocast or fp32 (the bf16 key); remove it",
    "torch_compile": "set compile (auto | loop | modules | off)",
    "evaluation_strategy": _STEPS,
    "eval_strategy": _STEPS,
    "save_strategy": _STEPS,
    "evals_per_epoch": _STEPS,
    "saves_per_epoch": _STEPS,
    "wandb_project": _WANDB,
    "wandb_entity": _WANDB,
    "wandb_name": "set run_name (and report_to: wandb)",
    "wandb_log_model": _WANDB,
    "xformers_attention": _KERNELS,
    "model_type": "hybridtune reads the model's class from its config.json; remove it",
    "tokenizer_type": "hybridtune loads the model's own tokenizer (or the tokenizer key's); remove it",
    "strict": "remove it",
    "special_tokens": "hybridtune trains with the tokenizer's own special tokens; remove it",
    "pad_to_sequence_len": "pack_layout: static fills every batch to one shape; remove it",
    "eval_sample_packing": "held-out examples are always evaluated in packs of sequence_len; remove it",
    "push_to_hub": _UPLOAD,
    "hub_model_id": _UPLOAD,
    "trust_remote_code": "hybridtune never runs code from a model directory; remove it",
    "template": "hybridtune renders chats with the tokenizer's template; set chat_template to change it",
    "stage": "set objective: sft, dpo, simpo or orpo",
    "pref_beta": "beta",
    "pref_loss": "set objective (dpo, simpo, orpo) and, for dpo, loss_type",
    "do_train": "hybridtune train trains; remove it",
    "dataset_prepared_path": "tokenised data is cached by its content and tokenizer; remove it",
    "group_by_length": "hybridtune packs examples into bins (sample_packing), not batches of like lengths; remove it",
    "wandb_watch": _WANDB,
    "per_device_eval_batch_size": "held-out examples are evaluated in packs of sequence_len; remove it",
    "eval_batch_size": "held-out examples are evaluated in packs of sequence_len; remove it",
}
# Keys of a `datasets` entry in other tools.
FOREIGN_DATASET_KEYS: dict[str, str] = {
    "data_files": "path",
    "ds_type": "hybridtune reads the format from the file's extension; remove it",
    "message_property_mappings": "set message_field_role and message_field_content",
    "chat_template": "set chat_template once at the top level",
    "train_on_eos": "chat turns are trained through their end token; remove it",
}
# Values of other tools for hybridtune keys: key -> value -> what to write instead.
FOREIGN_VALUES: dict[str, dict[str, str]] = {
    "type": {
        "chat_template": "Axolotl's chat_template is type: chat here (or auto; the tokenizer's template renders it)",
        "completion": "Axolotl's completion is type: text here",
    },
}
FOREIGN_VALUES["dataset_type"] = FOREIGN_VALUES["type"]


# Chat templates other tools name that are, for the Qwen3.5 and Qwen3-Next checkpoints hybridtune trains, the
# checkpoint's own: Qwen's ChatML (<|im_start|>role ... <|im_end|>), which hybridtune renders from the tokenizer.
CHATML_TEMPLATES = frozenset(
    "qwen qwen2 qwen2_5 qwen3 qwen3_5 qwen3_next qwen2_vl qwen2_5_vl qwen3_vl chatml tokenizer_default".split()
)
# Other model families' templates (LLaMA-Factory's `template`, Axolotl's `chat_template`): not the checkpoint's.
OTHER_TEMPLATES = frozenset(
    "llama2 llama3 llama3_2 llama4 mistral mistral_v7_tekken gemma gemma2 gemma3 phi_3 phi3 phi4 alpaca vicuna "
    "deepseek deepseek3 deepseekr1 cohere falcon zephyr jinja".split()
)


def _off(value: Any) -> bool:
    """false, empty or null: the key switched off or left blank."""
    return value is False or value is None or value in ("", [], {})


# Foreign keys -> the values of them that change nothing here, tested; the text says why when it is not plain.
_NOOPS: dict[str, tuple[Any, str]] = {
    **dict.fromkeys(
        "strict load_in_8bit group_by_length fp16 tf32 flash_attention sdp_attention xformers_attention deepspeed fsdp "
        "fsdp_config push_to_hub hub_model_id trust_remote_code special_tokens lora_target_linear quantization_bit "
        "bnb_4bit_quant_type bnb_4bit_compute_dtype attn_implementation".split(),
        (_off, ""),
    ),
    **{k: (_off, "") for k in ("wandb_project", "wandb_entity", "wandb_name", "wandb_log_model", "wandb_watch")},
    "eval_sample_packing": (lambda v: isinstance(v, bool), "held-out examples are always packed"),
    "pad_to_sequence_len": (lambda v: isinstance(v, bool), "the loss is the same; pack_layout decides the shapes"),
    "dataset_prepared_path": (lambda v: True, "tokenised data is cached by its content"),
    "do_train": (lambda v: v is True, ""),
    "stage": (lambda v: v == "sft", "objective: sft, the default"),
    "flash_attn": (lambda v: v == "auto" or _off(v), "hybridtune picks its kernels"),
    "model_type": (lambda v: isinstance(v, str) and v.startswith("Auto"), "the class comes from config.json"),
    "tokenizer_type": (lambda v: isinstance(v, str) and v.startswith("Auto"), "the model's own tokenizer"),
    "template": (lambda v: isinstance(v, str) and v in CHATML_TEMPLATES, "the checkpoint's own chat template"),
}


def noop(key: str, value: Any) -> str | None:
    """`key: value` as the warning lists it when that value of another tool's key changes nothing here, else None."""
    test, why = _NOOPS.get(key, (None, ""))
    if test is None or not test(value):
        return None
    if isinstance(value, bool):
        shown = str(value).lower()
    elif value is None:
        shown = "null"  # (a YAML key left blank)
    else:
        shown = value if isinstance(value, str) and value else repr(value)
    return f"{key}: {shown}" + (f" ({why})" if why else "")


def template_hint(value: Any) -> str | None:
    """What to do about another tool's template name that is not the checkpoint's; None for any other value."""
    if isinstance(value, str) and value in OTHER_TEMPLATES:
        return (
            f"'{value}' is another model family's template; hybridtune renders chats with the checkpoint's own "
            "(Qwen's ChatML): remove it, or set chat_template to a .jinja file to render them otherwise"
        )
    return None


# Keys renamed since a release: old name -> (new name, how its values map). An old config gets one line saying so.
RENAMED_KEYS: dict[str, tuple[str, dict]] = {
    # Inverted polarity: recompute_cores: true (the cores recomputed) is keep_mixer_cores: false.
    "recompute_cores": ("keep_mixer_cores", {True: False, False: True, "auto": "auto"}),
}


def renamed_key(key: str, value: Any, where: str) -> ConfigError | None:
    if key not in RENAMED_KEYS:
        return None
    new, values = RENAMED_KEYS[key]
    inverted = any(k != v for k, v in values.items())
    how = f" with the polarity inverted ('{key}: true' is '{new}: false')" if inverted else ""
    same = values.get(value) if isinstance(value, (bool, str)) else None
    instead = f"; write '{new}: {str(same).lower()}'" if same is not None else ""
    return ConfigError(f"{where}: config key '{key}' is now '{new}'{how}{instead}")
