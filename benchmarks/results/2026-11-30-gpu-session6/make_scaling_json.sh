#!/usr/bin/env bash
# Regenerates scaling.json from the four calls' files (run from this folder, with hybridtune importable).
python3 ../../dist/table.py callA callB callC callD --json scaling.json \
 --meta fla="0.6.0 (fla_core + flash_linear_attention wheels carried in .whl/)" --meta python=3.12 \
 --meta setup="qwen3_5-2b preset (random weights), 4096-token packs, 8 packs per optimizer step on every GPU count, 35 steps (callD: 25), hybridtune train defaults (compile loop, static pack layout, bf16, no gradient checkpointing), profile_steps 3 (callD: 0)" \
 --call callA="HYBRIDTUNE_GIT_COMMIT=5024d5b T0=555 bash bench/gpu/session6-a.sh" \
 --call callB="HYBRIDTUNE_GIT_COMMIT=efb9bac T0=555 bash bench/gpu/session6-b.sh" \
 --call callC="PHASES='one-full two-full' HYBRIDTUNE_GIT_COMMIT=efb9bac T0=540 bash bench/gpu/session6-a.sh" \
 --call callD="PHASES='one-lora two-lora' PROFILE=0 STEPS=25 HYBRIDTUNE_GIT_COMMIT=efb9bac T0=283 bash bench/gpu/session6-a.sh; then, on the same machine, PACKS=8 PROFILE=0 STEPS=25 RUN_T=84 bash bench/dist/gpu_dist.sh two-lora (no step within its 84 s)"
