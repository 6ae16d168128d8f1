#!/usr/bin/env bash
# On the GPU machine: SmolLM2 speculative decoding end to end on one GPU — regenerate the
# train subset's answers with the target, prepare, extract, train an EAGLE-3 draft, export
# it, and run `talon eval` with the target and the draft both on the GPU.
#   bench/spec_smollm2_gpu.sh GGUF TRAIN_DIR DEV_DIR WORK [STAGES]
# TRAIN_DIR holds sharegpt_1k/sharegpt_1k.jsonl and gsm8k/train.jsonl (../shared/data/train);
# DEV_DIR the question files (mt_bench.jsonl, alpaca.jsonl, humaneval.jsonl, and
# gsm8k_heldout.jsonl: the last 12 gsm8k train questions, outside the 2,200 regenerated).
# STAGES: a comma-separated subset of gen,prep,extract,train,export,eval (default: all).
# Every stage prints its wall time; each command resumes or refuses a changed job.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$1 train=$2 dev=$3 work=$4 stages=${5:-gen,prep,extract,train,export,eval}
T=build/talon
mkdir -p "$work"
want() { [[ ",$stages," == *",$1,"* ]]; }
timed() { local name=$1; shift; local t0=$SECONDS; "$@"; echo "== $name: $((SECONDS - t0)) s"; }
if want gen; then
  timed generate $T generate --model "$gguf" --data "$train/sharegpt_1k/sharegpt_1k.jsonl" "$train/gsm8k/train.jsonl" \
    --limit 2200 --out "$work/gen" --device cuda:0 --batch 256 --max-new-tokens 256 --max-len 2048 2>&1 | tail -4
fi
if want prep; then
  rm -rf "$work/tok"
  timed prepare $T prepare --model "$gguf" --data "$work/gen/generated.jsonl" --out "$work/tok" --max-length 2048 2>&1 | tail -2
fi
if want extract; then
  timed extract $T extract --model "$gguf" --data "$work/tok" --out "$work/feat" --device cuda 2>&1 | tail -2
fi
if want train; then
  timed train $T train --data "$work/feat" --model "$gguf" --out "$work/run" --device cuda --draft-vocab 8192 \
    --max-length 2048 --ttt-steps 7 --epochs 3 --lr 1e-3 --eval-fraction 0.05 --seed 1 2>&1 | tail -4
  python3 - "$work/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ev = [r for r in rows if r.get("split") == "eval"]
for r in ev[-1:]:
    print(f'held-back eval step {r["step"]}: acc {" ".join(f"{a:.3f}" for a in r["acc"])} sim tau {r["sim_accept_len"]:.3f}')
PY
fi
if want export; then
  rm -rf "$work/export"
  timed export $T export --checkpoint "$work/run" --model "$gguf" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format speculators --out "$work/export" 2>&1 | tail -1
fi
if want eval; then
  rm -rf "$work/eval"
  timed eval $T eval --model "$gguf" --draft "$work/export" --data "$dev/mt_bench.jsonl" "$dev/alpaca.jsonl" \
    "$dev/humaneval.jsonl" "$dev/gsm8k_heldout.jsonl" --limit-per-file "${EVAL_LIMIT:-10}" --max-new-tokens 128 \
    --chain 3,5,7 --tree "6,8,32;8,10,64" --temperatures 0,1 --device cuda:0 --out "$work/eval" 2>&1 | tail -40
fi
