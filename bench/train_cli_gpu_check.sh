#!/usr/bin/env bash
# `talon train` end to end on one GPU against the CPU trainer, for EAGLE-3, P-EAGLE and DFlash
# (the fixture llama_gqa target, synthetic features): the GPU run in exact fp32 (--gpu-math f32)
# logs the CPU run's losses to 1e-4 relative, with batches of several samples in micro-batches
# of 128 tokens, an evaluation split and a stop + resume; --gpu-profile prints the phase times.
# Usage: bench/train_cli_gpu_check.sh TALON   (after source build/env.sh)
set -uo pipefail
T=$1
M=tests/fixtures/golden/llama_gqa
W=${WORK:-/tmp/talon-gpucli}
rm -rf "$W"; mkdir -p "$W"
source "$(dirname "$0")/gqa_features.sh"
gqa_features "$T" "$W" 11 20 16 60 || { echo "extract failed"; exit 1; }
args=(train --data "$W/feat" --model $M --draft-vocab 64 --ttt-steps 3 --batch-samples 5 --epochs 2 --save-every 2
      --max-batch-tokens 128 --seed 2 --eval-fraction 0.2 --eval-every 2 --lr 1e-3)
status=0
# EAGLE-3, P-EAGLE and DFlash (COD elements and anchors seeded by (seed, step, slot), so CPU and
# GPU train on the same ones; every chain and every anchor at the held-back evaluation).
for drafter in eagle3 peagle dflash; do
  D="$W/$drafter"
  mkdir -p "$D"
  a=("${args[@]}" --drafter $drafter)
  [ $drafter = dflash ] && a+=(--draft-layers 2 --block-size 4 --max-anchors 6)
  # The fixture's data use every token id: P-EAGLE and DFlash need a mask token named.
  [ $drafter != eagle3 ] && a+=(--mask-token-id 96)
  "$T" "${a[@]}" --device cpu --out "$D/cpu" > /dev/null 2> "$D/cpu.err" || { echo "$drafter cpu: $(tail -2 "$D/cpu.err")"; exit 1; }
  "$T" "${a[@]}" --device cuda:0 --gpu-math f32 --gpu-profile --out "$D/gpu" > /dev/null 2> "$D/gpu.err" \
    || { echo "$drafter gpu: $(tail -2 "$D/gpu.err")"; exit 1; }
  grep "gpu profile" "$D/gpu.err" | head -3
  "$T" "${a[@]}" --device cuda:0 --gpu-math f32 --out "$D/gpu2" --stop-after-steps 3 > /dev/null 2>&1
  "$T" "${a[@]}" --device cuda:0 --gpu-math f32 --out "$D/gpu2" > /dev/null 2>&1
  python3 - "$D" "$drafter" <<'PY' || status=1
import json, sys
w = sys.argv[1]
def load(d): return [json.loads(l) for l in open(f"{w}/{d}/metrics.jsonl")]
cpu, gpu, res = load("cpu"), load("gpu"), load("gpu2")
worst = max(abs(a["loss"] - b["loss"]) / max(1.0, abs(a["loss"])) for a, b in zip(cpu, gpu))
same = [a["loss_exact"] for a in gpu] == [a["loss_exact"] for a in res]
print(f"{sys.argv[2]}: records cpu {len(cpu)} gpu {len(gpu)}; worst relative loss difference {worst:.2e}; "
      f"gpu stop + resume same bits: {same}")
sys.exit(0 if len(cpu) == len(gpu) and worst < 1e-4 and same else 1)
PY
done
exit $status
