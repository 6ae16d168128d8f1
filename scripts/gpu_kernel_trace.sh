#!/usr/bin/env bash
# Where a batch-1 verify's time goes, kernel by kernel: talon_bench_decode on the SmolLM2
# shape under Nsight Compute (one duration metric, kernels timed one at a time), for forwards
# of 1, 4 and 32 pending tokens and for the draft layer, each summed by bench/kernel_table.py.
# Run from the repository root on a GPU machine after `tar -xzf .gpucarry/deps.tgz`.
# Environment: SHAPE (default smollm2), CONTEXT (512), TOKENS ("1 4 32"), DRAFT_VOCAB (8192).
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-build}
TARGETS=talon_bench_decode bash scripts/gpu_build.sh || exit 1
shape=${SHAPE:-smollm2} ctx=${CONTEXT:-512} dv=${DRAFT_VOCAB:-8192}
common="--shape $shape --context $ctx --batches 1 --steps 0 --tree 0"
echo "== without the profiler"
build/talon_bench_decode $common --verify-tokens 1,2,4,8,32 --draft-vocab "$dv" | grep -vE "^\[|prefill"
trace() {  # name, bench arguments...
  local name=$1
  shift
  timeout 300 ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw --print-units base \
    build/talon_bench_decode $common "$@" > "$log/ncu_$name.csv" 2> "$log/ncu_$name.err"
  echo "== $name: $* (rc $?)"
  python3 bench/kernel_table.py "$log/ncu_$name.csv" --top 30
}
for n in ${TOKENS:-1 4 32}; do trace "v$n" --verify-tokens "$n"; done
trace draft --verify-tokens 1 --draft-vocab "$dv"
