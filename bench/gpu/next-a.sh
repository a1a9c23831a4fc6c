#!/usr/bin/env bash
# Planned next GPU call (nvidia-h200, the machine to itself): the bench of record at 4096 tokens, then the CUDA
# run of the compiled-loop tests. Each ht-loop variant compiles cold (2-3 min dynamic; the static layout is
# expected to take about half), so the modes are ordered by what the issues need first.
#   HYBRIDTUNE_GIT_COMMIT=<sha> T0=540 bash bench/gpu/next-a.sh      (carry .whl)
source bench/gpu/env.sh
T0=${T0:-540}
timeout $((T0 - 150)) $HT bench --modes ${MODES:-hf-eager,ht-loop,ht-loop:cg=on,ht-loop:layout=dynamic} --profile \
  --startup-timeout 300 --out-dir "$R/bench" > "$R/bench.log" 2>&1; echo "bench rc $?" >> "$R/bench.log"
left=$((T0 - SECONDS - 10))
HYBRIDTUNE_FLA_GRANT_FOR_TESTS=0 timeout $left python3 -m pytest -p no:cacheprovider -m cuda -v -rA \
  tests/compiler/test_loop.py > "$R/pytest_loop_cuda.log" 2>&1; echo "pytest rc $?" >> "$R/pytest_loop_cuda.log"
tar czf "$OUT/results.tar.gz" -C "$R" .
cat "$R/bench/bench.md" 2>/dev/null; tail -n 15 "$R/pytest_loop_cuda.log"
