"""The `memory` choice (runtime/memory_fit.py): before the first step, a line with the configured weights and
optimizer and their estimated peak; on a GPU whose free memory (a fake figure here, as `measure` would read it) it
does not fit, one warning naming the lighter setups that would, each with its estimate and the key to set (QLoRA for
LoRA on a bf16 base, adamw_8bit / adamw_bf16_sr for a full fine-tune with fp32 masters). Nothing is switched."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridtune.config import load_config
from hybridtune.errors import ConfigError
from hybridtune.models.loading import load_model
from hybridtune.models.presets import preset_config
from hybridtune.runtime import distributed, lora
from hybridtune.runtime.choices import resolve
from hybridtune.runtime.facts import Facts
from hybridtune.runtime.measure import measure
from hybridtune.runtime.memory import GIB, ActivationShapes, optimizer_bytes, step_bytes
from hybridtune.runtime.memory_fit import HOST_REFUSE, choose_memory, host_memory

N_2B = 1_881_825_088  # the 2B shape's values (qwen3_5-2b), all trainable in a full fine-tune
SHAPES_2B = ActivationShapes.of(preset_config("qwen3_5-2b"))
MASTERS = optimizer_bytes("adamw", N_2B, 2, True)  # fp32 gradients, masters and moments beside bf16 weights


def _full(free_gib: float) -> Facts:
    """A 2B full fine-tune with fp32 masters (bf16 weights as loaded) on a GPU with `free_gib` free."""
    return Facts(
        device="cuda", bf16_supported=True, gpu_free_bytes=int(free_gib * GIB), state_bytes=MASTERS,
        shapes=SHAPES_2B, resident_bytes=2 * N_2B, trainable=N_2B, trainable_bytes=2 * N_2B,
    )  # fmt: skip


def _peak(state: int, weights: int) -> float:
    est = step_bytes(SHAPES_2B, 4096, bf16=True, fused_loss=True, state_bytes=state)
    return (weights + est.without) / GIB


def test_a_full_fine_tune_that_fits_says_so_with_its_peak():
    cfg = load_config(None, {"adapter": "full", "sequence_len": 4096})
    c = choose_memory(cfg, _full(135), 4096, bf16=True, fused=True, checkpointing=False)
    assert c.value == "full fine-tune, adamw with fp32 masters" and not c.warnings
    assert c.reason.startswith(f"fits: about {_peak(MASTERS, 2 * N_2B):.1f} GiB at peak (4096-token"), c.reason


def test_a_full_fine_tune_that_does_not_fit_names_the_optims_that_would():
    """fp32 masters: 18 B a value (bf16 weight, fp32 gradient, master, two moments); adamw_8bit: 10 (fp32 weight and
    gradient, 8-bit moments) plus the bf16 copy autocast keeps; adamw_bf16_sr: 8 (bf16 weight, gradient, moments)."""
    cfg = load_config(None, {"adapter": "full", "sequence_len": 4096})
    c = choose_memory(cfg, _full(27), 4096, bf16=True, fused=True, checkpointing=False)
    room = 0.9 * 27 + 2 * N_2B / GIB  # FIT_SHARE of the free memory, beside the bf16 weights as loaded
    configured = _peak(MASTERS, 2 * N_2B)
    eight = _peak(N_2B * (4 + 2 + 2), 4 * N_2B)
    sr = _peak(N_2B * (2 + 4), 2 * N_2B)
    assert configured > eight > room > sr  # the figures of this case: only adamw_bf16_sr fits
    assert c.value == "full fine-tune, adamw with fp32 masters"  # never switched
    assert c.reason.startswith(f"does not fit: about {configured:.1f} GiB at peak"), c.reason
    (w,) = c.warnings
    assert "\n" not in w and f"needs about {configured:.1f} GiB at peak" in w, w
    assert f"set optim: adamw_bf16_sr about {sr:.1f} GiB (fits); not optim: adamw_8bit about {eight:.1f} GiB" in w, w


@pytest.fixture(scope="module")
def tiny_lora():
    cfg = load_config(None, {"adapter": "lora", "bf16": True, "sequence_len": 64, "gradient_checkpointing": False})
    model = load_model("tiny-qwen3_5", dtype=torch.bfloat16).model
    return cfg, lora.apply_lora(model, cfg.lora_r, cfg.lora_alpha, 0.0, list(cfg.lora_target_modules))


def test_lora_on_a_bf16_base_that_does_not_fit_names_qlora(tiny_lora):
    """Measured on the tiny preset with LoRA (its figures), then a GPU with less free than its step needs: the
    warning names `load_in_4bit: true` with the peak of the NF4 base, whose saving the facts carry."""
    cfg, model = tiny_lora
    facts = measure(cfg, torch.device("cpu"), distributed.ONE, model, bf16=True)
    assert 0 < facts.nf4_saving < facts.resident_bytes and facts.nf4_transient > 0
    assert 0 < facts.trainable < sum(p.numel() for p in model.parameters())
    est = step_bytes(facts.shapes, 64, bf16=True, fused_loss=True, state_bytes=facts.state_bytes)
    nf4 = step_bytes(facts.shapes, 64, bf16=True, fused_loss=True, state_bytes=facts.state_bytes + facts.nf4_transient)
    need, qlora = facts.resident_bytes + est.without, facts.resident_bytes - facts.nf4_saving + nf4.without
    assert qlora < need
    # free memory between QLoRA's need and LoRA's, as measure reads it beside the loaded model
    free = ((need + qlora) / 2 - facts.resident_bytes) / 0.9
    gpu = dataclasses.replace(facts, device="cuda", gpu_free_bytes=int(free))
    c = resolve(cfg, gpu).memory
    assert c.value == "lora on a bf16 base, adamw", c.value
    (w,) = c.warnings
    assert f"set load_in_4bit: true (QLoRA) about {qlora / GIB:.1f} GiB (fits)" in w, w
    roomy = resolve(cfg, dataclasses.replace(gpu, gpu_free_bytes=int(2 * need))).memory
    assert roomy.reason.startswith("fits: ") and not roomy.warnings


def test_the_cpu_line_weighs_the_step_against_the_machines_memory(tiny_lora):
    """On the CPU the peak is compared with the machine's memory (measured: `host_bytes`): within it a plain line,
    past it one warning, past HOST_REFUSE times it (a sequence_len of a billion swapped for ever) refused in one
    line before the step; a machine that does not say gives the estimate alone."""
    cfg, model = tiny_lora
    facts = measure(cfg, torch.device("cpu"), distributed.ONE, model, bf16=True)
    assert facts.host_bytes == host_memory() and facts.host_bytes > 2**30
    c = resolve(cfg, facts).memory
    assert "GiB at peak" in c.reason and "GiB of this machine's memory" in c.reason and not c.warnings, c.reason
    est = step_bytes(facts.shapes, 64, bf16=True, fused_loss=True, state_bytes=facts.state_bytes)
    need = facts.resident_bytes + est.without
    small = resolve(cfg, dataclasses.replace(facts, host_bytes=need // 2)).memory
    (w,) = small.warnings
    assert small.reason.startswith("does not fit: ") and "\n" not in w and "may swap or be killed" in w, w
    assert "a shorter sequence_len or micro_batch_size needs less (64 tokens a micro-batch now)" in w, w
    with pytest.raises(ConfigError, match=r"^memory: .* over 4 times the .* GiB of this machine's memory: a shorter"):
        resolve(cfg, dataclasses.replace(facts, host_bytes=need // (HOST_REFUSE + 1)))
    silent = resolve(cfg, dataclasses.replace(facts, host_bytes=None)).memory
    assert "no GPU memory to compare with" in silent.reason and not silent.warnings


def test_train_refuses_a_step_far_past_the_machines_memory(tmp_path, capsys):
    """Through `hybridtune train` on the tiny preset: a sequence_len of a billion is one line, exit 2, before a
    step (it allocated for ever)."""
    from hybridtune.cli import main

    out = tmp_path / "run"
    argv = ["train", "--max_steps", "1", "--sequence_len", "1000000000", "--output_dir", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "this machine's memory: a shorter sequence_len" in lines[0], err
    assert "Traceback" not in err and "training tiny-qwen3_5" not in err
    assert not list(out.glob("checkpoint-*")) and not (out / "final").exists()
