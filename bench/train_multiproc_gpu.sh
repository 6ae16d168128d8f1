#!/usr/bin/env bash
# Multi-process GPU training on whatever GPUs the machine has: one process with every GPU
# (--device cuda) against the same job as processes started the way torchrun starts them
# (RANK/WORLD_SIZE/LOCAL_RANK, no MPI: the NCCL id travels through a file in --out), with
# the same total GPU count. Prints whether the logged losses are the same bits.
# Usage: bench/train_multiproc_gpu.sh TALON PROCS [GPUS_PER_PROC]   (after source build/env.sh)
set -uo pipefail
T=$1 P=$2 G=${3:-1}
M=tests/fixtures/golden/llama_gqa
W=${WORK:-/tmp/talon-mp}
rm -rf "$W"; mkdir -p "$W"
source "$(dirname "$0")/gqa_features.sh"
gqa_features "$T" "$W" 7 24 24 40 || { echo "extract failed"; exit 1; }
args=(train --data "$W/feat" --model $M --draft-vocab 64 --ttt-steps 3 --batch-samples 6 --epochs 2 --save-every 3
      --max-batch-tokens 128 --gpu-math f32 --seed 1 --eval-fraction 0.2 --eval-every 3 --lr 1e-3)
devs=$(seq -s, 0 $((P * G - 1)))
"$T" "${args[@]}" --device "cuda:$devs" --out "$W/one" > "$W/one.out" 2> "$W/one.err"
echo "one process, cuda:$devs: rc $? $(tail -1 "$W/one.err")"
pids=()
for r in $(seq 0 $((P - 1))); do
  RANK=$r WORLD_SIZE=$P LOCAL_RANK=$r LOCAL_WORLD_SIZE=$P MASTER_PORT=29511 \
    "$T" "${args[@]}" --device cuda --out "$W/multi" > "$W/r$r.out" 2> "$W/r$r.err" &
  pids+=($!)
done
for r in $(seq 0 $((P - 1))); do wait "${pids[$r]}"; echo "rank $r: rc $? $(tail -2 "$W/r$r.err" | tr '\n' ' ')"; done
strip() { python3 -c "
import json,sys
for l in open(sys.argv[1]):
    r=json.loads(l); r.pop('tokens_per_s',None); print(json.dumps(r,sort_keys=True))" "$1"; }
if [ -f "$W/multi/metrics.jsonl" ] && [ "$(strip "$W/one/metrics.jsonl")" = "$(strip "$W/multi/metrics.jsonl")" ]; then
  echo "SAME BITS: $P processes x $G GPU(s) = one process with $((P * G)) GPUs ($(wc -l < "$W/one/metrics.jsonl") records)"
else
  echo "DIFFERENT or missing"; diff <(strip "$W/one/metrics.jsonl") <(strip "$W/multi/metrics.jsonl" 2>/dev/null) | head -5
fi
