"""`hybridtune bench` on MoE shapes: expert LoRA flag, NAME@layers=N, FLOPs by what peft applied, the experts path
of each mode reported; a CPU smoke run (slow tier) with hf-eager and the hybridtune modes at loss parity."""

from __future__ import annotations

import json

import pytest

from hybridtune.bench import probes, results, worker
from hybridtune.bench.command import parse_args
from hybridtune.cli import main
from hybridtune.models.flops import step_flops
from hybridtune.models.presets import preset_config


def test_expert_lora_flag_parses():
    assert parse_args(["--lora_target_parameters", "gate_up_proj,down_proj"]).lora_target_parameters == (
        "gate_up_proj,down_proj"
    )
    assert parse_args([]).lora_target_parameters == ""
    assert parse_args(["--lora-target-parameters", "down_proj"]).lora_target_parameters == "down_proj"


def test_bad_layer_cut_is_one_line(capsys):
    assert main(["bench", "--base_model", "qwen3_5-35b-a3b@layers=99"]) == 2
    err = capsys.readouterr().err.strip()
    assert "layers must be a whole number from 1 to 40" in err and "\n" not in err


def test_flops_follow_what_peft_applied():
    """The worker charges the modules and expert parameters peft adapted (recorded in the result), not the flags."""
    cfg = preset_config("tiny-qwen3_next")
    spec = {"warmup": 1, "steps": 2, "adapter": "lora", "lora_r": 4, "lora_targets": ["q_proj", "gate_proj"]}
    batches = [{"doc_lens": [7, 9]}]
    applied = {"lora_modules": ["q_proj"], "lora_parameters": ["gate_up_proj", "down_proj"]}
    result = dict(applied)
    probes.flops(spec, False, False, cfg, batches, [1.0, 1.0], result)
    want = step_flops(cfg, [7, 9], lora_r=4, lora_targets=["q_proj"], lora_parameters=["gate_up_proj", "down_proj"])
    assert result["model_flops_per_step"] == want.model
    plain = step_flops(cfg, [7, 9], lora_r=4, lora_targets=["q_proj", "gate_proj"])
    assert want.breakdown["lora"] != plain.breakdown["lora"]


def test_results_rows_name_the_cut_and_expert_lora():
    doc = {
        "date": "2026-12-01T00:00:00",
        "git_commit": "abc",
        "device": "d",
        "command": "hybridtune bench",
        "settings": {"preset": "qwen3_5-35b-a3b@layers=8", "seq_len": 8, "adapter": "lora", "lora_r": 16}
        | {"lora_parameters": ["gate_up_proj", "down_proj"]},
        "modes": {"hf-eager": {"error": "x"}},
    }
    (row,) = results.bench_rows(doc, source="t")
    assert row["adapter"] == "lora r=16 +experts" and row["shape"] == "qwen3_5-35b-a3b@layers=8"
    # its label in the docs' tables (35B-A3B@layers=8): tests/bench/test_results.py, with the renderer


@pytest.mark.slow  # three modes, each in its own process, one of them compiled
def test_bench_moe_cpu_smoke(tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "--base_model", "tiny-qwen3_5_moe@layers=2", "--modes", "hf-eager,ht-eager,ht-loop"]
    args += ["--lora_target_parameters", "gate_up_proj,down_proj", "--steps", "2", "--warmup", "1", "--layouts", "2"]
    args += ["--sequence_len", "128", "--compile_backend", "aot_eager", "--output_dir", str(out)]
    assert main(args) == 0
    doc = json.loads((out / "bench.json").read_text())
    assert doc["settings"]["lora_parameters"] == ["gate_up_proj", "down_proj"]
    base = doc["modes"]["hf-eager"]
    assert "grouped_mm" in base["experts"] and base["experts_lora"] == "peft's ParamWrapper forward"
    for label in ("ht-eager", "ht-loop"):
        r = doc["modes"][label]
        assert "error" not in r, r.get("error")
        assert (
            r["experts"].startswith("2 layer(s): hybridtune_grouped") and r["experts_lora"] == "grouped in 2 layer(s)"
        )
        assert sorted(r["lora_parameters"]) == ["down_proj", "gate_up_proj"]
        assert r["trainable_params"] == base["trainable_params"]
        assert r["model_flops_per_step"] == base["model_flops_per_step"]
        assert r["losses"] == pytest.approx(base["losses"], rel=1e-4)  # same weights, data, seeds
    loop = doc["modes"]["ht-loop"]
    assert loop["graph_breaks"] == 0 and loop["recompiles_after_warmup"] == 0
    assert "Routed experts per mode:" in (out / "bench.md").read_text()


def test_expert_gemm_rate_from_a_profile():
    """Grouped-GEMM kernels' time from the profile's kernel table against the experts' FLOPs: top-k experts per
    row, 4 per weight (frozen) + 2 recompute, LoRA 6 + 2 per adapter parameter."""
    from hybridtune.bench.report import markdown

    cfg = preset_config("tiny-qwen3_5_moe")
    kernels = [
        ["void cutlass::device_kernel<...GroupProblemShape...>", 2.0, 8],
        ["triton_tem_fused__grouped_mm_0", 1.0, 4],
        ["ampere_bf16_s16816gemm", 5.0, 3],  # a dense GEMM: not the experts'
    ]
    g = probes.expert_gemm_rate({"kernels_ms_per_step": kernels}, cfg, "lora", 8, ["gate_up_proj"], True, 100.0)
    h, k, i, n = cfg.hidden_size, cfg.num_experts_per_tok, cfg.moe_intermediate_size, 4
    base = 6 * n * k * (h * 2 * i + i * h) * 100
    lora = 8 * n * k * 8 * (h + 2 * i) * 100
    assert g["kernel_ms_per_step"] == 3.0 and g["flops_per_step"] == base + lora
    assert g["tflops_per_s"] == pytest.approx((base + lora) / 3e-3 / 1e12)
    # A profile's own grouped-GEMM sum (full kernel names) wins over its kernel table
    g2 = probes.expert_gemm_rate(
        {"kernels_ms_per_step": kernels, "grouped_gemm_ms_per_step": 4.0}, cfg, "lora", 8, ["gate_up_proj"], True, 100.0
    )
    assert g2["kernel_ms_per_step"] == 4.0
    # An older profile's table holds CUTLASS's names cut at 120 characters (as the H200's 35B-A3B profile did)
    cut = "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17GroupProblem"
    g3 = probes.expert_gemm_rate({"kernels_ms_per_step": [[cut, 71.5, 400]]}, cfg, "full", 0, [], False, 10.0)
    assert g3["kernel_ms_per_step"] == 71.5
    from hybridtune.bench.report import _gemm_rate

    # a profile that found none says so (the H200's 35B-A3B bench.md said nothing when the matcher missed them)
    assert (
        _gemm_rate({"kernel_ms_per_step": 0, "flops_per_step": 1.0}) == "; no grouped-GEMM kernel found in the profile"
    )
    assert _gemm_rate(None) == ""
    assert probes.expert_gemm_rate({}, cfg, "full", 0, [], False, 10.0) == {
        "kernel_ms_per_step": 0,
        "flops_per_step": 6 * n * k * 3 * h * i * 10,
    }
    doc = {
        "settings": {"preset": "p", "seq_len": 8, "adapter": "full", "dtype": "bf16", "steps": 2, "warmup": 1},
        "device": "d",
        "git_commit": "abc",
        "modes": {"ht-loop": {"error": "x", "experts": "4 layer(s): hybridtune_grouped", "expert_gemms": g}},
    }
    assert "grouped-GEMM kernels 3.0 ms/step" in markdown(doc)


def _profiled_tiny_moe(**lora) -> dict:
    """A worker spec: hf-eager on a 2-layer tiny Qwen3.5-MoE, one warm-up and one timed step, then the profile."""
    spec = {"kind": "mode", "mode": "hf-eager", "preset": "tiny-qwen3_5_moe@layers=2", "seq_len": 64, "layouts": 2}
    return (
        spec | {"seed": 0, "warmup": 1, "steps": 1, "adapter": "lora", "lora_r": 4, "lr": 1e-4, "profile": True} | lora
    )


def test_profiled_moe_run_keeps_stepping(monkeypatch):
    """A profiled MoE run with expert LoRA goes on stepping after the profile (the host-sync step): on the H200 the
    35B-A3B hf-eager row was lost to `clip_grad_norm_` receiving the expert parameters' names. The CUDA-only
    pieces are stood in for; the step, the model and the expert-GEMM count are the real ones, on the CPU."""
    kernels = [["void cutlass::grouped_gemm_kernel", 2.0, 3]]

    def fake_profile(run, steps, device):
        for i in range(steps):
            run(i)
        return {"kernels_ms_per_step": kernels}

    def fake_syncs(run_step):
        run_step()
        return {"count": 0, "by_line": {}}

    monkeypatch.setattr(probes, "can_profile", lambda device: True)
    monkeypatch.setattr(probes, "profile_run", fake_profile)
    monkeypatch.setattr(probes, "find_syncs", fake_syncs)
    spec = _profiled_tiny_moe(lora_targets=["q_proj"], lora_parameters=["gate_up_proj", "down_proj"])
    result = worker.run_mode(spec)
    assert result["host_syncs"] == {"count": 0, "by_line": {}}
    assert result["expert_gemms"]["kernel_ms_per_step"] == 2.0 and result["expert_gemms"]["tflops_per_s"] > 0
    assert len(result["losses"]) == 2


def test_a_failing_profile_keeps_the_timed_steps(monkeypatch):
    """The timed steps are measured before the profile: a profile that raises leaves them in the result (with the
    error beside them, and a line in the report), not an errored mode (10 minutes of an H200 call were lost so)."""
    from hybridtune.bench import report

    def broken(run, steps, device):
        raise RuntimeError("CUPTI is not available")

    monkeypatch.setattr(probes, "can_profile", lambda device: True)
    monkeypatch.setattr(probes, "profile_run", broken)
    spec = _profiled_tiny_moe(lora_targets=["in_proj_qkv"])
    result = worker.run_mode(spec)
    assert result["tokens_per_s"] > 0 and len(result["losses"]) == 2
    assert result["profile_error"] == "RuntimeError: CUPTI is not available" and "profile" not in result
    doc = {"device": "cpu", "git_commit": "0" * 40, "modes": {"hf-eager": result}}
    doc["settings"] = {"preset": "tiny", "seq_len": 64, "adapter": "lora", "lora_r": 4, "dtype": "fp32"}
    doc["settings"] |= {"steps": 1, "warmup": 1}
    text = report.markdown(doc)
    assert "Profile failed (the timed figures above stand): hf-eager: RuntimeError" in text
