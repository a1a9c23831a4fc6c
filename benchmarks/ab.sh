#!/usr/bin/env bash
# Is a speed difference between two commits the code or the machine? One bench mode at two commits on the same
# lent GPU, in one call: old, new, old again (the second old run says how much one machine varies).
#
#   here:         bash benchmarks/ab.sh prepare OLD_REV NEW_REV    # .ab/old/src and .ab/new/src (git archive), ignored
#   lent machine: END=SECONDS_LEFT bash benchmarks/ab.sh run "OLD_MODE" "NEW_MODE"   (carry .ab, .whl, .whlx)
# e.g. the restructuring's question (2026-12-03): prepare b8f7578 b4ca016; run "ht-loop:cg=on,regions=on,sac=on"
# "ht-loop:cuda_graphs=on,compile_regions=true,keep_mixer_cores=true". Each run's log and bench.json land in $OUT.
set -o pipefail
case "${1:-}" in
  prepare)
    grep -qx '/.ab/' .git/info/exclude 2>/dev/null || echo '/.ab/' >> .git/info/exclude
    rm -rf .ab && mkdir -p .ab/old .ab/new
    git archive "$2" src | tar -x -C .ab/old && git archive "$3" src | tar -x -C .ab/new
    echo "$(git rev-parse "$2") $(git rev-parse "$3")" > .ab/revs; du -sh .ab ;;
  run)
    export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1 TRITON_CACHE_DIR=/tmp/tcache TORCHINDUCTOR_CACHE_DIR=/tmp/icache
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    PYTHONPATH=/tmp/site python3 -c "import datasets" >/dev/null 2>&1 || python3 -m pip install -q --no-index --no-deps \
      --no-compile --no-cache-dir --upgrade --target /tmp/site .whlx/*.whl
    out=${OUT:-/tmp/ab-out}; mkdir -p "$out"; END=${END:-540}
    read -r rev_old rev_new < .ab/revs
    one() {  # one NAME SRC MODE (each side's bench.json records its own commit, not the checkout's)
      local rev=$rev_old; [ "$2" = new ] && rev=$rev_new
      (HYBRIDTUNE_GIT_COMMIT=$rev PYTHONPATH=/tmp/site:$PWD/.ab/$2/src timeout $(( END - SECONDS )) python3 -m hybridtune bench --modes "$3" \
         --startup_timeout 300 --output_dir "/tmp/ab-$1" > "$out/ab-$1.log" 2>&1; echo "rc $? at ${SECONDS}s" >> "$out/ab-$1.log")
      cp "/tmp/ab-$1/bench.json" "$out/ab-$1.json" 2>/dev/null; grep -h "^| ht-" "/tmp/ab-$1/bench.md" 2>/dev/null
    }
    one old old "$2"; one new new "$3"; one old2 old "$2"
    tail -qn 1 "$out"/ab-*.log ;;
  *) sed -n '2,10p' "$0"; exit 2 ;;
esac
