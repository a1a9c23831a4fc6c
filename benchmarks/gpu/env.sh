# Sourced by the GPU scripts of session 3 on: wheels, caches, output folder, CPU split.
# Run from the repo root with .whl/ (FLA 0.6.0, einops, liger-kernel) and, when present, .cache/ carried.
# Sets: R (results folder), HT (the CLI), A0/A1 (taskset prefixes for the two GPUs' jobs).
# save_cache: the Triton + inductor caches into $OUT/cache.tar.gz.part-* (at most 4 x 15 MB; the Triton
# cache alone when both do not fit), for the next call's `.cache/`.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcache TORCHINDUCTOR_CACHE_DIR=/tmp/icache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src
R=${R:-/tmp/res}; mkdir -p "$R"
if [ ! -d /tmp/tcache ] && ls .cache/cache.tar.gz.part-* >/dev/null 2>&1; then
  cat .cache/cache.tar.gz.part-* | tar xzf - -C /; echo "caches restored: $(du -sh /tmp/tcache /tmp/icache | tr '\n' ' ')"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.txt" 2>&1
HT="python3 -m hybridtune"
A0=""; A1=""
if command -v taskset >/dev/null; then A0="taskset -c 0-${SPLIT:-19}"; A1="taskset -c $((${SPLIT:-19} + 1))-$(($(nproc) - 1))"; fi

save_cache() {
  [ -n "${OUT:-}" ] || return 0
  tar czf /tmp/cache.tgz -C / tmp/tcache tmp/icache 2>/dev/null
  if [ "$(stat -c %s /tmp/cache.tgz)" -gt 62000000 ]; then tar czf /tmp/cache.tgz -C / tmp/tcache; fi
  if [ "$(stat -c %s /tmp/cache.tgz)" -le 62000000 ]; then split -b 15M /tmp/cache.tgz "$OUT/cache.tar.gz.part-"; fi
  ls -la "$OUT"
}
