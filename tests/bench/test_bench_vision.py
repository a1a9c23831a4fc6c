"""`hybridtune bench --vision` (bench/vl_data.py, bench/vl_modes.py): the vision tower's FLOP count against torch's
FLOP counter, the documents' sizes, and (slow tier) the modes on the tiny preset's VL shape: hybridtune's packed step
beside transformers + peft on the same documents in padded batches, loss for loss, and transformers' padding-free
path."""

from __future__ import annotations

import math

import pytest
import torch

from hybridtune.bench import vl_data, vl_modes
from hybridtune.bench.modes import parse_mode
from hybridtune.errors import ConfigError


def test_tower_flops_equal_torch_flop_counter():
    """`tower_flops` of a frozen tower's forward over two images (one frame group each, different grids) equals what
    torch's FlopCounterMode counts for it (the patch embedding's conv, every matmul, attention's per image under
    eager attention: the counter does not count the CPU's sdpa kernel); elementwise work is in neither."""
    import transformers as tf
    from torch.utils.flop_counter import FlopCounterMode

    vcfg = tf.Qwen3_5VisionConfig(**vl_data.VISION_TINY, out_hidden_size=64)
    tower = tf.models.qwen3_5.modeling_qwen3_5.Qwen3_5VisionModel._from_config(vcfg, attn_implementation="eager")
    tower.eval()
    grids = [(1, 6, 8), (1, 4, 10)]
    patch_in = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size**2
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch_in)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=torch.tensor(grids))
    counted = counter.get_total_flops()
    ours = vl_modes.tower_flops(vcfg, grids)
    assert math.isclose(ours, counted, rel_tol=1e-3), (ours, counted)


def test_document_ranges_scale_to_the_pack():
    assert vl_data.scale(8192) == 1.0  # the GPU's packs: 256-1,280 visual tokens per image, 1-4 images
    assert vl_data.LONGEST <= 8192
    s = vl_data.scale(512)
    assert 0 < s < 1 and vl_data._range(vl_data.VISUAL, s)[1] * 4 < 512


def test_hf_pf_is_the_vision_bench_mode():
    mode = parse_mode("hf-pf")
    assert mode.flatten and not mode.patch
    with pytest.raises(ConfigError):
        parse_mode("hf-pf:objective=dpo")


def test_vision_refuses_other_shapes_and_objectives(tmp_path, capsys):
    from hybridtune.cli import main

    for args in (["--base_model", "tiny-qwen3_5_moe"], ["--modes", "ht-eager:objective=dpo"]):
        assert main(["bench", "--vision", *args, "--output_dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert "--vision benches sft on a dense Qwen3.5 preset" in err


def _spec(tmp, mode: str) -> dict:
    return {
        "kind": "mode",
        "mode": mode,
        "preset": "tiny-qwen3_5",
        "seq_len": 256,
        "steps": 2,
        "warmup": 1,
        "layouts": 2,
        "adapter": "lora",
        "lora_r": 4,
        "lora_targets": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "lora_parameters": [],
        "lr": 1e-3,
        "seed": 0,
        "compile_backend": "aot_eager",
        "vision": True,
        "vision_dir": str(tmp),
        "model_dir": str(tmp / vl_data.MODEL_DIR),
        "peak_flops_per_s": 1e12,
    }


@pytest.mark.slow
def test_vision_bench_modes_on_the_tiny_vl_shape(tmp_path):
    """The tiny preset's VL checkpoint and documents; hybridtune's packed step (ht-eager) and transformers + peft on
    the same documents padded (hf-eager) give the same loss at every step (fp32: the same sums, so 1e-5), count the
    same tokens (text + visual, no padding) and FLOPs (the tower's included); hf-pf runs and says its loss."""
    from hybridtune.bench.worker import run_mode

    info = vl_data.prepare(tmp_path, "tiny-qwen3_5", 256, 2, 0, "float32")
    packs = vl_data.load_packs(tmp_path)
    for p in packs:
        assert sum(len(d["ids"]) for d in p) <= 256
        for d in p:
            assert 1 <= len(d["images"]) <= 4
            assert sum(d["mask"]) > 0 and all(m == 0 for m in d["mask"][: d["images"][-1][2]])
    assert info["visual_tokens_per_pack"] == [sum(im[3] for d in p for im in d["images"]) for p in packs]
    runs = {m: run_mode(_spec(tmp_path, m)) for m in ("hf-eager", "ht-eager", "hf-pf")}
    hf, ht, pf = runs["hf-eager"], runs["ht-eager"], runs["hf-pf"]
    assert len(ht["losses"]) == 3
    for a, b in zip(hf["losses"], ht["losses"]):
        assert math.isclose(a, b, rel_tol=1e-5), (hf["losses"], ht["losses"])
    assert hf["step_tokens"] == ht["step_tokens"] == pf["step_tokens"]
    assert ht["step_tokens"][0] == sum(len(d["ids"]) for d in packs[1])  # step 2 = the second pack: text + visual
    assert hf["model_flops_per_step"] == ht["model_flops_per_step"] > 0
    assert all(math.isfinite(x) for x in pf["losses"])
