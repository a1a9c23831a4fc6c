"""Quiet where hybridtune is in control: no transformers reference-fallback notices in generate's output, no
"slow path ... doctor" warning on a machine without a faster path, no peft warning at an offline LoRA save; and one
argument form for MODEL: `merge` takes a run's output directory as generate does, says a full fine-tune has
nothing to merge, and a mistyped local path is said not to exist instead of being looked up on the hub."""

from __future__ import annotations

import json
import logging
import shutil
import warnings

import pytest
import torch

from checkpoints import fake_sha, hub_cache, make_checkpoint
from hybridtune import cli
from hybridtune.cli import main
from hybridtune.config import load_config
from hybridtune.kernels.provision import provision_kernels
from hybridtune.models import hub
from hybridtune.train.trainer import Trainer

NOTICE = "`chunk_gated_delta_rule` is falling back to its reference PyTorch implementation because ..."


def test_the_filter_drops_the_fallback_notice_only():
    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord(cli.FALLBACK_LOGGER, logging.WARNING, __file__, 1, msg, None, None)

    assert cli.drop_fallback_notice(record(NOTICE)) is False
    assert cli.drop_fallback_notice(record("something else transformers says")) is True


def test_generate_prints_no_fallback_notice(tmp_path, capfd):
    """A Qwen3.5-MoE checkpoint's GDN layers run transformers' reference ops without FLA: transformers says so four
    times (seen here by a filter ahead of ours); the command's output holds none of it."""
    ckpt = make_checkpoint(tmp_path, "qwen3_5_moe_vl")
    seen: list[str] = []
    log = logging.getLogger(cli.FALLBACK_LOGGER)
    log.filters.insert(0, lambda r: seen.append(r.getMessage()) or True)
    logging.Logger.warning_once.cache_clear()  # (transformers says each notice once per process)
    try:
        assert main(["generate", str(ckpt), "--prompt", "hi", "--max_new_tokens", "2"]) == 0
    finally:
        del log.filters[0]
    out, err = capfd.readouterr()
    if not torch.cuda.is_available():  # (with FLA on a GPU, transformers has nothing to say)
        assert sum(cli.FALLBACK_NOTICE in m for m in seen) >= 2, seen
    assert "falling back" not in out + err and "reference PyTorch" not in out + err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_no_slow_path_warning_where_no_faster_path_exists(caplog):
    caplog.set_level(logging.INFO, logger="hybridtune")
    report = provision_kernels("auto", False, "tiny-qwen3_5", selftest=False)
    assert report.gaps  # the reference path runs ...
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not any("slow path" in m or "doctor" in m for m in warned), warned  # ... and nothing asks for a fix
    assert "no GPU: the mixers run hybridtune's pure-torch reference ops" in caplog.text


@pytest.fixture
def lora_run(tmp_path, monkeypatch):
    """A one-step LoRA run on a hub id (the hub cache, offline), with any warning at its save recorded."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    ckpt = make_checkpoint(tmp_path, "qwen3_5_text")
    monkeypatch.setenv("HF_HOME", str(hub_cache(tmp_path, "acme/tiny", ckpt, fake_sha("main"))))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": f"{i} + {i} = {2 * i}"}) for i in range(12)) + "\n")
    out = tmp_path / "run"
    cfg = load_config(None, dict(base_model="acme/tiny", dataset=str(data), adapter="lora", output_dir=str(out),
                                 max_steps=1, eval_steps=0, val_set_size=0, warmup_steps=0))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(cfg)
        t.setup()
        t.train()
    return out, [str(w.message) for w in caught]


def test_an_offline_lora_save_says_nothing_of_peft_and_merge_takes_the_run_directory(lora_run, tmp_path):
    out, caught = lora_run
    assert (out / "final" / "adapter_config.json").is_file()
    assert not [w for w in caught if "Could not find a config file" in w], caught
    merged = tmp_path / "merged"
    assert main(["merge", str(out), str(merged)]) == 0  # the run directory, as generate and eval take it
    assert (merged / "config.json").is_file() and any(merged.glob("*.safetensors"))


def test_merge_says_what_holds_no_adapter(tmp_path, capsys):
    full = tmp_path / "full-run"
    shutil.copytree(make_checkpoint(tmp_path, "qwen3_5_text"), full / "final")
    (full / "hybridtune_run.json").write_text(json.dumps({"config": {}}))
    cases = {
        str(full): "is a full model (config.json, no adapter_config.json): nothing to merge",
        str(full / "final"): "nothing to merge; a full fine-tune's final/ is already the whole model",
        str(tmp_path / "my-modle"): "does not exist",
    }
    ck = tmp_path / "r2" / "checkpoint-3"
    ck.mkdir(parents=True)
    (ck / "checkpoint.json").write_text("{}")
    cases[str(ck)] = "is a training checkpoint, not an adapter: export it first"
    for spec, said in cases.items():
        assert main(["merge", spec, str(tmp_path / "merged")]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if " INFO " not in line]
        assert len(err) == 1 and err[0].startswith("error: ") and said in err[0], (spec, err)
    assert not (tmp_path / "merged").exists()


def test_a_mistyped_local_path_is_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys):
    def no_hub(*a, **kw):
        raise AssertionError("looked up on the hub")

    monkeypatch.setattr(hub, "download", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "d.jsonl").write_text('{"text": "1 + 1 = 2"}\n')
    for argv in (
        ["generate", "./my-modle", "--prompt", "hi"],
        ["eval", "--model", "../my-modle", "--dataset", "d.jsonl"],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "my-modle': no such directory" in err[0] and "does not exist" in err[0], err
