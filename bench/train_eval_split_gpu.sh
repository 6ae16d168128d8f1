#!/usr/bin/env bash
# On the GPU machine: is `talon train --device cuda`'s held-back evaluation right? Trains the
# same short job under several GPU engine options, side by side, and compares each run's own
# "split": "eval" metrics with the held-back acc_k that bench/quality_vs_specforge_ref.py
# computes from the exported weights (same split, same definitions; it matches the CPU
# trainer's evaluation to 2e-3 on SmolLM2 features).
#   bench/train_eval_split_gpu.sh GGUF FEAT_DIR WORK
# FEAT_DIR: a `talon extract` dataset (e.g. WORK/feat of bench/quality_vs_specforge.sh).
# Env: TALON (build/talon), SF_SITE (where specforge==0.2.0 is installed), SEED (2), STEPS (400).
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$1 feat=$2 work=$3
T=${TALON:-build/talon} SEED=${SEED:-2} STEPS=${STEPS:-400}
export PYTHONPATH=${SF_SITE:+$SF_SITE:}${PYTHONPATH:-} TORCHDYNAMO_DISABLE=1 PYTHONUNBUFFERED=1
mkdir -p "$work"
declare -A V=(
  [default]=""
  [logits_one_chunk]="--gpu-logit-rows 16384"
  [attention_blocks]="--gpu-attention blocks"
  [fp32_operands]="--gpu-fp32-operands"
  [math_f32]="--gpu-math f32"
  [batch_2048]="--max-batch-tokens 2048"
)
t0=$SECONDS
pids=()
for v in "${!V[@]}"; do
  rm -rf "$work/$v" "$work/$v.sglang"
  ( $T train --data "$feat" --model "$gguf" --out "$work/$v" --device cuda --draft-vocab 8192 --max-length 2048 \
      --ttt-steps 7 --max-steps "$STEPS" --lr 1e-3 --warmup-steps 6 --eval-fraction 0.05 --seed "$SEED" \
      --save-every 1000000 ${V[$v]} > "$work/$v.log" 2>&1 &&
    $T export --checkpoint "$work/$v" --model "$gguf" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format sglang --out "$work/$v.sglang" >> "$work/$v.log" 2>&1 ) &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
echo "== train ${#V[@]} variants: $((SECONDS - t0)) s"
[ $rc = 0 ] || { tail -n 3 "$work"/*.log; exit 1; }
drafts=()
for v in "${!V[@]}"; do drafts+=("$work/$v.sglang"); done
python3 bench/quality_vs_specforge_ref.py heldout --feat "$feat" --gguf "$gguf" --seed "$SEED" --eval-fraction 0.05 \
  --draft "${drafts[@]}" --json "$work/heldout.json" 2>&1 | grep -v -i warn
python3 - "$work" "${!V[@]}" <<'PY'
import json, sys
work, names = sys.argv[1], sys.argv[2:]
ho = json.load(open(f"{work}/heldout.json"))
print("| variant | trainer's eval acc_0..6 | sim tau | weights re-evaluated acc_0..6 | sim tau |")
print("|---|---|---|---|---|")
for v in sorted(names):
    ev = [json.loads(l) for l in open(f"{work}/{v}/metrics.jsonl") if '"split":"eval"' in l][-1]
    h = ho[f"{work}/{v}.sglang"]
    f = lambda a: " ".join(f"{x:.3f}" for x in a)
    print(f"| {v} | {f(ev['acc'])} | {ev['sim_accept_len']:.3f} | {f(h['acc'])} | {h['sim_accept_len']:.3f} |")
PY
