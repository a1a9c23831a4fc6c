# Shared setup, sourced by single_gpu.sh, scaling.sh and kernels.sh. Run from the repo root; on a lent GPU machine
# carry .whl/ (FLA, einops, datasets, dill, multiprocess; liger-kernel for hf-liger: ../shared/tools/gpu-wheels.sh
# einops==0.8.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19), .whlx/ (pyarrow==26.0.1, used only if needed) and, when there, .cache/ (Triton + inductor caches of a call before).
# Sets: R (work folder, default /tmp/res), HT (the CLI), RESULTS (the results table rows are appended to),
#   lane_cpus I N (a taskset prefix giving lane I of N its share of the cores; CPUS_<I>="0-10" overrides),
#   save_cache (the Triton + inductor caches into $OUT/cache.tar.gz.part-*, at most 4 x 15 MB, for the next call),
#   finish (the work folder and the results table into $OUT when it is set).
# HYBRIDTUNE_GIT_COMMIT=<the 40-digit sha: the results table takes no short one> names the code where the machine's copy of .git is stale or absent.
set -o pipefail
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/tcache}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/icache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if command -v nvidia-smi >/dev/null && [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then  # the lent machine
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}
# `datasets` (hybridtune's data loading) is not on the lent machine's image: .whl/ carries it with dill and
# multiprocess; its pyarrow (>= 24) travels in .whlx/ and is installed only where the image's is too old for it.
if ! python3 -c "import datasets" >/dev/null 2>&1 && ls .whlx/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whlx/*.whl
fi
python3 -c "import datasets" >/dev/null 2>&1 || echo "warning: datasets does not import: hybridtune train cannot read data"
R=${R:-/tmp/res}; mkdir -p "$R"
RESULTS=${RESULTS:-$PWD/benchmarks/results.jsonl}
if [ ! -d "$TRITON_CACHE_DIR" ] && ls .cache/cache.tar.gz.part-* >/dev/null 2>&1; then
  cat .cache/cache.tar.gz.part-* | tar xzf - -C /; echo "caches restored: $(du -sh "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR" | tr '\n' ' ')"
fi
# The run machine's date, commit, device and versions: rows brought back here are added with --provenance from it.
${PY:-python3} -m hybridtune.bench.results provenance > "$R/provenance.json" 2>/dev/null || rm -f "$R/provenance.json"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$R/nvidia-smi.txt" 2>&1
HT="${PY:-python3} -m hybridtune"

lane_cpus() {  # lane_cpus I N
  local i=$1 n=$2 own
  own=$(eval "echo \${CPUS_$i:-}")
  command -v taskset >/dev/null || return 0
  if [ -n "$own" ]; then echo "taskset -c $own"; return 0; fi
  [ "$n" -gt 1 ] || return 0
  local c per; c=$(nproc); per=$((c / n))
  echo "taskset -c $((i * per))-$(( i == n - 1 ? c - 1 : (i + 1) * per - 1 ))"
}

save_cache() {
  [ -n "${OUT:-}" ] || return 0
  tar czf /tmp/cache.tgz -C / "${TRITON_CACHE_DIR#/}" "${TORCHINDUCTOR_CACHE_DIR#/}" 2>/dev/null
  if [ "$(stat -c %s /tmp/cache.tgz)" -gt 62000000 ]; then tar czf /tmp/cache.tgz -C / "${TRITON_CACHE_DIR#/}"; fi
  if [ "$(stat -c %s /tmp/cache.tgz)" -le 62000000 ]; then split -b 15M /tmp/cache.tgz "$OUT/cache.tar.gz.part-"; fi
}

finish() {
  [ -n "${OUT:-}" ] || return 0
  tar czf "$OUT/work.tar.gz" -C "$R" --exclude long.jsonl .
  [ -f "$RESULTS" ] && cp "$RESULTS" "$OUT/results.jsonl"
  [ "${SAVE_CACHE:-0}" = 1 ] && save_cache
  return 0
}
