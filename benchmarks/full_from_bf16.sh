#!/usr/bin/env bash
# What does a full fine-tune of a bf16 checkpoint hold on the GPU, now that it keeps fp32 masters (issue 17)?
# Builds the qwen3_5-0.8b preset, saves it as a bf16 checkpoint, then `hybridtune train --adapter full` on it for a
# few steps (compile off, kernels off: the question is memory and dtypes, not speed) and prints the step lines
# (mem = peak GiB) and the dtypes of the trained parameters and AdamW state. One call on nvidia-h200, carry .whl
# (FLA) and .whl_b (datasets, dill, multiprocess: the image lacks them):
#   HYBRIDTUNE_GIT_COMMIT=<sha> bash benchmarks/full_from_bf16.sh
# Then the same through `hybridtune train` (RUN_STEPS steps, a step line each), its metrics left as
# $OUT/full-1.metrics.jsonl for `python -m hybridtune.bench.results add-train $OUT full-1 --shape $SHAPE --packs 1`.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-$PWD/outputs/full_from_bf16} W=${W:-/tmp/full_from_bf16} PY=${PY:-python3}
SHAPE=${SHAPE:-qwen3_5-0.8b} SEQ=${SEQ:-2048} STEPS=${STEPS:-4} RUN_STEPS=${RUN_STEPS:-20}
mkdir -p "$OUT" "$W"
if command -v nvidia-smi >/dev/null && ls .whl*/*.whl >/dev/null 2>&1 && [ ! -d /tmp/site ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl*/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
{
  $PY - "$SHAPE" "$W/ckpt" <<'PY'
import sys, time, torch
from hybridtune.models.loading import load_model
t = time.time()
m = load_model(sys.argv[1], dtype=torch.bfloat16)
m.model.save_pretrained(sys.argv[2]); m.tokenizer.save_pretrained(sys.argv[2])
n = sum(p.numel() for p in m.model.parameters())
print(f"saved {sys.argv[1]} as a bf16 checkpoint: {n/1e9:.3f}B parameters in {time.time()-t:.0f} s")
PY
  $PY - "$W/ckpt" "$W/run" "$SEQ" "$STEPS" <<'PY'
import sys, torch
from hybridtune.config import load_config
from hybridtune.train.trainer import Trainer
cfg = load_config(None, dict(base_model=sys.argv[1], output_dir=sys.argv[2], adapter="full", sequence_len=int(sys.argv[3]),
                             max_steps=int(sys.argv[4]), compile="off", kernels="off", logging_steps=1, eval_steps=0,
                             val_set_size=8, warmup_steps=0, learning_rate=1e-5, overwrite=True))
t = Trainer(cfg); t.setup(); r = t.train(); t.close()
params = {str(p.dtype) for p in t.model.parameters() if p.requires_grad}
state = {str(v.dtype) for s in t.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0}
n = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
print(f"trainable {n/1e9:.3f}B parameters: dtypes {sorted(params)}; AdamW state {sorted(state)}; bf16 autocast {t.use_bf16}")
print(f"peak GPU memory {torch.cuda.max_memory_allocated()/2**30:.2f} GiB allocated, "
      f"{torch.cuda.max_memory_reserved()/2**30:.2f} GiB reserved; losses {[round(x, 4) for x in r.losses]}")
PY
  $PY -m hybridtune train --base_model "$W/ckpt" --output_dir "$W/cli" --adapter full --sequence_len "$SEQ" \
    --max_steps "$RUN_STEPS" --compile off --kernels off --logging_steps 1 --eval_steps 0 --val_set_size 8 \
    --warmup_steps 0 --learning_rate 1e-5 --save_steps 0 --overwrite
  rc=$?
  cp "$W/cli/metrics.jsonl" "$OUT/full-1.metrics.jsonl" 2>/dev/null
  echo "exit $rc" >"$OUT/full-1.log"
} 2>&1 | tee "$OUT/full_from_bf16.log"
