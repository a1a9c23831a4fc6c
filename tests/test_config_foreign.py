"""Configs written for other tools (Axolotl, LLaMA-Factory, TRL): every problem said in one run, each foreign key
with what hybridtune takes instead, and the spellings hybridtune shares (all-linear, warmup_ratio) understood."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re

import pytest
import torch

from hybridtune.config import FOREIGN_DATASET_KEYS, FOREIGN_KEYS, DatasetConfig, TrainConfig, load_config
from hybridtune.errors import ConfigError

AXOLOTL = """\
base_model: Qwen/Qwen3.5-0.8B
load_in_4bit: true
adapter: qlora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_target_modules: all-linear
datasets:
  - path: chats.jsonl
    type: chat_template
    field_messages: messages
sequence_len: 2048
sample_packing: true
micro_batch_size: 2
gradient_accumulation_steps: 4
num_epochs: 1
optimizer: adamw_bnb_8bit
lr_scheduler: cosine
learning_rate: 0.0002
warmup_ratio: 0.03
output_dir: {out}
"""


def test_an_axolotl_config_gives_all_its_errors_in_one_run(tmp_path, capsys):
    from hybridtune.cli import main

    p = tmp_path / "axolotl.yaml"
    p.write_text(AXOLOTL.format(out=tmp_path / "out"))
    assert main(["train", str(p)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert "Traceback" not in err
    # load_in_4bit: true with adapter: qlora is QLoRA (runtime/quant.py), as Axolotl means it
    assert lines[0] == "error: 2 problems in the config (each below; fix them all, nothing was run):", lines
    problems = lines[1:]
    assert len(problems) == 2, problems
    assert "axolotl.yaml:10: key 'datasets[0].type'" in problems[0] and "type: chat here" in problems[0]
    assert "axolotl.yaml:17: unknown config key 'optimizer'" in problems[1]
    assert "tokenizer" not in problems[1]
    assert not (tmp_path / "out").exists()  # nothing ran


def test_the_supported_part_of_an_axolotl_config_is_accepted(tmp_path):
    p = tmp_path / "axolotl.yaml"
    text = AXOLOTL.format(out=tmp_path / "out").replace("chat_template", "chat")
    p.write_text("\n".join(line for line in text.splitlines() if not line.startswith("optim")))
    cfg = load_config(p)
    assert (cfg.adapter, cfg.load_in_4bit) == ("lora", True)  # adapter: qlora + load_in_4bit: true
    assert cfg.lora_target_modules == ["all-linear"] and cfg.warmup_ratio == 0.03
    assert cfg.datasets[0].type == "chat" and cfg.lora_dropout == 0.05


@pytest.mark.parametrize(
    "key, value, ours",
    [
        ("lr", "2e-4", "learning_rate"),
        ("num_train_epochs", "3", "num_epochs"),
        ("per_device_train_batch_size", "4", "micro_batch_size"),
        ("lora_rank", "8", "lora_r"),
        ("cutoff_len", "2048", "sequence_len"),
        ("max_seq_length", "1024", "sequence_len"),
        ("model_name_or_path", "Qwen/Qwen3.5-0.8B", "base_model"),
        ("lr_scheduler_type", "linear", "lr_scheduler"),
    ],
)
def test_a_key_hybridtune_has_under_another_name(tmp_path, key, value, ours):
    p = tmp_path / "c.yaml"
    p.write_text(f"lora_r: 4\n{key}: {value}\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(e.value).endswith(
        f"c.yaml:2: unknown config key '{key}'; did you mean '{ours}'? (the same setting: write '{ours}: {value}')"
    )


@pytest.mark.parametrize(
    "key, says",
    [
        ("load_in_8bit: true", "quantized base is NF4 (torchao; bf16 compute): set load_in_4bit: true"),
        ("quantization_bit: 4", "set load_in_4bit: true"),
        ("bnb_4bit_quant_type: nf4", "no bnb_* keys"),
        ("deepspeed: ds_z3.json", "run with --nproc N and set distributed"),
        ("fsdp: full_shard auto_wrap", "run with --nproc N and set distributed"),
        ("flash_attention: true", "picks its attention and linear-attention kernels itself"),
        ("lora_target_linear: true", "write lora_target_modules: all-linear"),
        ("lora_target: all", "all-linear (LLaMA-Factory's all)"),
        ("finetuning_type: lora", "set adapter: lora or adapter: full"),
        ("use_peft: true", "set adapter: lora"),
        ("evaluation_strategy: steps", "set eval_steps / save_steps"),
    ],
)
def test_a_key_hybridtune_lacks_says_what_to_use(tmp_path, key, says):
    p = tmp_path / "c.yaml"
    p.write_text(f"{key}\n")
    with pytest.raises(ConfigError, match=rf"c\.yaml:1: unknown config key '{key.split(':')[0]}': .*{re.escape(says)}"):
        load_config(p)


def test_llama_factory_and_trl_configs_name_every_key(tmp_path):
    p = tmp_path / "lf.yaml"
    p.write_text(
        "model_name_or_path: Qwen/Qwen3.5-0.8B\nstage: sft\ndo_train: true\nfinetuning_type: lora\nlora_target: all\n"
        "template: qwen3\ncutoff_len: 2048\nper_device_train_batch_size: 1\nnum_train_epochs: 3.0\n"
        "learning_rate: 1.0e-4\nbf16: true\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("5 problems in the config")
    named = [line.split("unknown config key '")[1].split("'")[0] for line in lines[1:]]
    # stage: sft, do_train: true, template: qwen3 and per_device_train_batch_size: 1 change nothing here: not problems
    assert named == ["model_name_or_path", "finetuning_type", "lora_target", "cutoff_len", "num_train_epochs"]
    p.write_text("max_length: 1024\npacking: false\nuse_peft: true\ndataset_text_field: text\nlearning_rate: 2.0e-5\n")
    with pytest.raises(ConfigError, match="4 problems") as e:
        load_config(p)
    assert "did you mean 'sample_packing'? (the same setting: write 'sample_packing: false')" in str(e.value)


def test_foreign_dataset_keys(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "datasets:\n  - path: a.jsonl\n    type: chat_template\n    message_property_mappings:\n"
        "      role: from\n    data_files: b.jsonl\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(p)
    text = str(e.value)
    assert "c.yaml:4: datasets[0]: unknown config key 'message_property_mappings': set message_field_role" in text
    assert "c.yaml:6: datasets[0]: unknown config key 'data_files'; did you mean 'path'?" in text


def test_the_foreign_tables_name_real_keys():
    ours = {f.name for f in dataclasses.fields(TrainConfig)}
    ours_ds = {f.name for f in dataclasses.fields(DatasetConfig)}
    assert not set(FOREIGN_KEYS) & ours and not set(FOREIGN_DATASET_KEYS) & ours_ds
    for table, keys in ((FOREIGN_KEYS, ours), (FOREIGN_DATASET_KEYS, ours_ds)):
        for key, what in table.items():
            assert what in keys or " " in what, (key, what)  # a key of ours, or words


# --- warmup_ratio ------------------------------------------------------------------------------------------------


def test_warmup_ratio_is_a_share_of_the_run_and_exclusive_with_warmup_steps(tmp_path):
    from hybridtune.config import to_dict
    from hybridtune.runtime.optim import build_optimizer, build_scheduler, warmup_steps

    with pytest.raises(ConfigError, match="'warmup_steps' = 5 is set beside warmup_ratio; the two are exclusive"):
        load_config(None, {"warmup_ratio": 0.1, "warmup_steps": 5})
    # A run's recorded config (every key, warmup_steps at its default) loads again, as generate and export read it.
    recorded = to_dict(load_config(None, {"warmup_ratio": 0.1}))
    assert load_config(None, recorded, warn=False).warmup_ratio == 0.1
    for bad in (1.0, -0.1):
        with pytest.raises(ConfigError, match=r"'warmup_ratio' = .* must be in \[0, 1\)"):
            load_config(None, {"warmup_ratio": bad})
    cfg = load_config(None, {"warmup_ratio": 0.03, "lr_scheduler": "constant", "learning_rate": 1.0})
    assert warmup_steps(cfg, 1000) == 30 and warmup_steps(cfg, 10) == 1
    p = torch.nn.Parameter(torch.zeros(2))
    opt = build_optimizer([p], cfg, torch.device("cpu"))
    sched = build_scheduler(opt, cfg, 1000)
    lrs = []
    for _ in range(31):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1 / 30) and lrs[28] < 1.0 and lrs[29] == lrs[30] == 1.0
    # Without it, warmup_steps as before.
    assert warmup_steps(load_config(None, {"warmup_steps": 7}), 1000) == 7


def test_warmup_ratio_never_warns_that_warmup_outlasts_the_run(caplog):
    from hybridtune.config import warmup_warning

    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        cfg = load_config(None, {"warmup_ratio": 0.5, "max_steps": 3})
    assert "warmup" not in caplog.text and warmup_warning(cfg, 3) is None


# --- lora_target_modules: all-linear ------------------------------------------------------------------------------


def test_all_linear_alone_or_not_at_all():
    assert load_config(None, {"lora_target_modules": "all-linear"}).lora_target_modules == ["all-linear"]
    with pytest.raises(ConfigError, match="names all-linear beside other modules; give all-linear alone"):
        load_config(None, {"lora_target_modules": ["all-linear", "q_proj"]})


def test_all_linear_adapts_every_linear_of_the_decoder_layers(tmp_path):
    from checkpoints import make_checkpoint
    from hybridtune.models.loading import load_model
    from hybridtune.runtime.lora import applied_targets, apply_lora

    model = load_model("tiny-qwen3_5@layers=4").model
    layers = {n.rsplit(".", 1)[-1] for n, m in model.model.layers.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {"in_proj_a", "in_proj_b", "q_proj", "down_proj"} <= layers
    # r=16 is above in_proj_a's 4 outputs: all-linear takes such narrow layers as peft does.
    peft_model = apply_lora(model, 16, 32, 0.0, ["all-linear"])
    assert set(applied_targets(peft_model)[0]) == layers
    assert not any("lm_head" in n for n in peft_model.base_model.targeted_module_names)
    with pytest.raises(ConfigError, match="larger than the largest sensible rank"):
        apply_lora(load_model("tiny-qwen3_5@layers=4").model, 10**6, 8, 0.0, ["all-linear"])
    vl = load_model(str(make_checkpoint(tmp_path, "qwen3_5_vl", torch.float32))).model
    adapted = apply_lora(vl, 4, 8, 0.0, ["all-linear"]).base_model.targeted_module_names
    assert adapted and all(n.startswith("model.language_model.layers.") for n in adapted)


# --- no-op keys of other tools: one warning line; keys that change training stay refused ---------------------------

KEPT = """\
base_model: tiny-qwen3_5
model_type: AutoModelForCausalLM
tokenizer_type: AutoTokenizer
strict: false
load_in_8bit: false
datasets:
  - path: {data}
    type: chat
dataset_prepared_path: last_run_prepared
val_set_size: 0
output_dir: {out}
sequence_len: 128
sample_packing: true
pad_to_sequence_len: true
wandb_project:
wandb_entity:
wandb_watch:
wandb_log_model:
group_by_length: false
tf32: false
flash_attention: false
special_tokens:
chat_template: chatml
lr_scheduler_type: cosine
max_steps: 1
eval_steps: 0
"""


def _chats(path, n):
    rows = []
    for _ in range(n):
        a, b = random.randint(0, 999), random.randint(0, 999)
        rows.append(
            {"messages": [{"role": "user", "content": f"{a}+{b}="}, {"role": "assistant", "content": f"{a + b}"}]}
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_an_axolotl_config_with_no_op_keys_trains_after_one_warning_line(tmp_path, capsys):
    from hybridtune.cli import main

    data = _chats(tmp_path / "d.jsonl", random.randint(9, 17))
    p = tmp_path / "axolotl.yaml"
    p.write_text(KEPT.format(data=data, out=tmp_path / "out"))
    rc = main(["train", str(p)])
    err = capsys.readouterr().err  # (the CLI's log goes to stderr, not through the root logger)
    assert rc == 0, err
    said = [line for line in err.splitlines() if "another tool" in line]
    assert len(said) == 1 and " WARNING " in said[0], said
    for item in ("strict: false", "load_in_8bit: false", "wandb_project: null", "group_by_length: false",
                 "model_type: AutoModelForCausalLM", "chat_template: chatml", "lr_scheduler_type: 'cosine'"):  # fmt: skip
        assert item in said[0], (item, said[0])
    assert (tmp_path / "out" / "final").is_dir()


def test_keys_that_would_change_training_stay_refused_all_at_once(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(
        "strict: false\nload_in_8bit: true\ngroup_by_length: true\nwandb_project: mine\nlr_scheduler_type: linear\n"
        "template: llama3\nchat_template: gemma\nstage: dpo\n"
    )
    with pytest.raises(ConfigError) as e:
        load_config(p, warn=False)
    lines = str(e.value).splitlines()
    assert lines[0].startswith("7 problems in the config"), lines
    text = str(e.value)
    assert "strict" not in text  # the no-op among them is no problem
    assert "c.yaml:2: unknown config key 'load_in_8bit': hybridtune's quantized base is NF4" in text
    assert "c.yaml:3: unknown config key 'group_by_length': hybridtune packs examples into bins" in text
    assert "c.yaml:4: unknown config key 'wandb_project': set report_to: wandb" in text
    assert "c.yaml:5: unknown config key 'lr_scheduler_type'; did you mean 'lr_scheduler'?" in text
    assert "c.yaml:6: unknown config key 'template': 'llama3' is another model family's template" in text
    assert "c.yaml:7: key 'chat_template': 'gemma' is another model family's template" in text
    assert "c.yaml:8: unknown config key 'stage': set objective" in text


def test_qwen_template_names_are_the_checkpoints_own(tmp_path, caplog):
    name = random.choice(["qwen3", "qwen3_5", "chatml", "qwen"])
    p = tmp_path / "c.yaml"
    p.write_text(f"template: {name}\nchat_template: {name}\nstage: sft\ndo_train: true\n")
    with caplog.at_level(logging.WARNING, logger="hybridtune"):
        cfg = load_config(p)
    assert cfg.chat_template is None and cfg.objective == "sft"
    assert f"template: {name} (the checkpoint's own chat template" in caplog.text
    # A template file of that name is a file, as before.
    f = tmp_path / name
    f.write_text("{{ messages }}")
    assert load_config(None, {"chat_template": str(f)}, warn=False).chat_template == str(f)


@pytest.mark.parametrize("key", ["strict", "group_by_length", "eval_batch_sz", "optim_args", "save_safetensors"])
def test_did_you_mean_only_for_a_close_key(tmp_path, key):
    p = tmp_path / "c.yaml"
    p.write_text(f"{key}: 7\n")
    with pytest.raises(ConfigError) as e:
        load_config(p, warn=False)
    assert "did you mean" not in str(e.value), str(e.value)


@pytest.mark.parametrize("typo, key", [("learing_rate", "learning_rate"), ("micro_batchsize", "micro_batch_size"),
                                       ("seqence_len", "sequence_len"), ("num_epoch", "num_epochs")])  # fmt: skip
def test_did_you_mean_still_names_a_typo(tmp_path, typo, key):
    p = tmp_path / "c.yaml"
    p.write_text(f"{typo}: 3\n")
    with pytest.raises(ConfigError, match=f"unknown config key '{typo}'; did you mean '{key}'"):
        load_config(p, warn=False)


@pytest.mark.parametrize("key", ["template", "chat_template"])
def test_a_template_given_as_a_list_or_mapping_is_one_line(tmp_path, key):
    p = tmp_path / "c.yaml"
    p.write_text(f"{key}: {random.choice(['[qwen3, chatml]', '{name: qwen3}'])}\n")
    with pytest.raises(ConfigError, match=f"c\\.yaml:1: (unknown config key '{key}'|key '{key}')"):
        load_config(p, warn=False)
