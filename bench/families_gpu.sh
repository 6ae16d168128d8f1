#!/usr/bin/env bash
# The drafter families on one GPU machine, end to end on SmolLM2 and the demo chats: EAGLE-3,
# P-EAGLE and DFlash trained on the GPU,
# then `talon eval` with the target on the GPU for each: greedy equality with target-only GPU
# decoding (near-ties named), tau and per-position acceptance. A plumbing check, not a quality
# measurement: 8 demo chats train nothing useful.
# Usage: bench/families_gpu.sh GGUF WORK
set -uo pipefail
G=$1 W=$2
T=build/talon
mkdir -p "$W"
TALON_SMOLLM2_GGUF=$G bash tests/cli/fixture/demo_features.sh "$T" "$PWD" "$W/demo" || exit 1
common=(--data "$W/demo/feat" --model "$G" --draft-vocab 2048 --max-length 256 --max-steps 24 --epochs 3 --lr 1e-3
        --batch-samples 2 --eval-fraction 0.15)
$T train "${common[@]}" --ttt-steps 3 --device cuda --out "$W/e3" 2>&1 | grep -E "train complete|eval after|error"
$T train "${common[@]}" --drafter peagle --ttt-steps 3 --device cuda --out "$W/pe" 2>&1 |
  grep -E "train complete|eval after|error"
$T train "${common[@]}" --drafter dflash --draft-layers 2 --block-size 4 --max-anchors 32 --device cuda \
  --out "$W/df" 2>&1 | grep -E "train complete|eval after|error"
for d in e3 pe df; do
  $T eval --model "$G" --data examples/demo_chats.jsonl --limit 6 --max-new-tokens 48 --chain 3 --no-tree \
    --draft "$W/$d" --device cuda --out "$W/ev-$d" 2>&1 | grep -E "draft on|error|differs" | head -5
  python3 - "$W/ev-$d/eval.json" "$d" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1]))["results"] if r["category"] == "all"]
for r in rows:
    s, g = r["speculative"], r["greedy_equal"]
    print(f"{sys.argv[2]:3} {r['config']:8} turns {r['turns']:2} greedy equal {g['compared'] - g['differ']}/{g['compared']}"
          f" (near-ties {g['near_ties']}) tau {s['tau']:.3f} per-position {[round(x, 3) for x in s['accept_rate_per_depth']]}"
          f" speedup {r['speedup']:.2f}x")
PY
done
