#!/usr/bin/env bash
# Where a batch-1 decode step's idle time goes. CUPTI traces of 3 greedy graph steps of the 8B
# shape (context 2048) and the SmolLM2 shape (context 512), two ways: as shipped, and with
# programmatic dependent launches off (TALON_CUDA_PDL=0: graphs without programmatic edges, so
# each kernel's traced time is its own, not its wait too). Launches without graphs are the
# table's eager column (the bench turns graphs on and off itself). For each: the step's ms, the
# device's idle time by the host call it overlaps, and the kernels (bench/kernel_table.py). One call:
#   source scripts/gpu_carried.sh; bash bench/decode_gaps_gpu.sh    (traces go to $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
for shape in llama3-8b smollm2; do
  ctx=2048; [ "$shape" = smollm2 ] && ctx=512
  for how in shipped nopdl; do
    envs=()
    [ "$how" = nopdl ] && envs=(TALON_CUDA_PDL=0)
    log="$out/gaps-$shape-$how"
    echo "== $shape, context $ctx, $how"
    env "${envs[@]}" build/talon_bench_decode --shape "$shape" --context "$ctx" --batches 1 --steps 24 --tree 0 \
      --verify-tokens 1 --accept-chain 0 --trace "$log.json" > "$log.txt" 2>&1 || { tail -3 "$log.txt"; continue; }
    grep -E "^ +(slots|1) +" "$log.txt"
    sed -n '/^trace of 3/,/^longest gaps/p' "$log.txt" | grep -v "^longest gaps"
    python3 bench/kernel_table.py "$log.json" --per 3 --top 8
  done
done
