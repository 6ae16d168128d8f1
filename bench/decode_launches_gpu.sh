#!/usr/bin/env bash
# Batch-1 decode steps, verifies and speculative rounds with the decode path's dependent launches
# switched by kind (ops.h: TALON_CUDA_PDL, a mask of kDepend* bits), in one call, every setting
# run twice in alternation so that the call's noise shows. CONFIGS: "name:mask ..."; default
#   none      0    ordinary launches
#   products  1    the skinny products only (the default before kDepend*)
#   default   39   all but the attention and its combine (kDependDefault, 103, adds bit 64: the
#                  draft trainers' kernels, none of them in decode)
#   all       63   every decode kernel
# Shapes: Llama-3.1-8B at context 2048 (EAGLE-3 draft, Vd 32000) and SmolLM2 at 512 (Vd 8192).
#   source scripts/gpu_carried.sh; bash bench/decode_launches_gpu.sh    (logs go to $OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$(mktemp -d)}
CONFIGS=${CONFIGS:-"none:0 products:1 default:39 all:63"}
for rep in 1 2; do
  for shape in llama3-8b smollm2; do
    ctx=2048 vd=32000
    [ "$shape" = smollm2 ] && ctx=512 vd=8192
    for cfg in $CONFIGS; do
      IFS=: read -r name mask <<< "$cfg"
      log="$out/launches-$shape-$name-$rep.txt"
      TALON_CUDA_PDL=$mask build/talon_bench_decode --shape "$shape" --context "$ctx" --batches 1 --steps 32 \
        --verify-tokens 1 4 32 --tree 32 --draft-vocab "$vd" --accept-chain 0 > "$log" 2>&1 || { tail -3 "$log"; continue; }
      printf "%-9s %-9s run %s: " "$shape" "$name" "$rep"
      awk -v ctx="$ctx" '$1 == "1" && $2 == ctx { printf "step %s ms; ", $5 }
        /chain +4 tokens/ { printf "verify-4 %s; ", $4 } /tree +32 tokens/ { printf "tree-32 %s; ", $4 }
        /chain-3 +round/ { printf "chain-3 round %s; ", $3 } /tree d6 k8 n32 +round/ { printf "tree round %s", $6 }
        END { printf "\n" }' "$log"
    done
  done
done
