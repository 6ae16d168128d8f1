#!/usr/bin/env bash
# EAGLE-3, P-EAGLE and DFlash side by side on SmolLM2, one GPU. All three train on the same
# regenerated features with the same token budget: the same samples, epochs, batch, learning
# rate schedule and seed. Then each is decoded with `talon eval` on the same dev subsets at
# batch 1, greedy, with the target on the GPU, and a table is printed:
# * held-back acc_0 and simulated tau from the trainer's held-back evaluation;
# * dev tau per chain length (P-EAGLE drafts a chain in one pass; DFlash drafts a block,
#   capped at block - 1 tokens);
# * speedup over target-only decoding, with the greedy-equivalence count;
# * training tokens/s and wall time.
# WORK is a bench/regen_smollm2_gpu.sh work directory after its extract and eval stages:
# WORK/feat holds the features, WORK/dev the dev subsets.
#   bench/families_smollm2_gpu.sh GGUF WORK [FAMILIES]
# Environment: EPOCHS (2), VD (8192), K (7: EAGLE-3 TTT steps, P-EAGLE depths, DFlash block K+1),
# DF_LAYERS (5), CHAINS ("3,7"), MAX_NEW (128), MAX_STEPS (0: every epoch), DEVICE (cuda; cpu runs the
# same flow on the CPU, for a small WORK).
set -uo pipefail
cd "$(dirname "$0")/.."
gguf=$1 work=$2 families=${3:-eagle3,peagle,dflash}
T=${TALON:-build/talon}
EPOCHS=${EPOCHS:-2} VD=${VD:-8192} K=${K:-7} DF_LAYERS=${DF_LAYERS:-5} CHAINS=${CHAINS:-3,7} MAX_NEW=${MAX_NEW:-128}
MAX_STEPS=${MAX_STEPS:-0} DEVICE=${DEVICE:-cuda}
eval_device=$DEVICE
[ "$DEVICE" = cuda ] && eval_device=cuda:0
[ -d "$work/feat" ] && [ -d "$work/dev" ] || { echo "$work: expected feat/ and dev/ (bench/regen_smollm2_gpu.sh)" >&2; exit 2; }
common=(--data "$work/feat" --model "$gguf" --device "$DEVICE" --draft-vocab "$VD" --max-length 2048 --epochs "$EPOCHS"
        --lr 1e-3 --schedule cosine --clip 0.5 --eval-fraction 0.02 --seed 1 --save-every 1000000)
[ "$MAX_STEPS" -gt 0 ] && common+=(--max-steps "$MAX_STEPS")
for d in ${families//,/ }; do
  case $d in
    eagle3) extra=(--ttt-steps "$K") ;;
    peagle) extra=(--drafter peagle --ttt-steps "$K") ;;
    dflash) extra=(--drafter dflash --draft-layers "$DF_LAYERS" --block-size $((K + 1)) --max-anchors 512) ;;
    *) echo "family $d: expected eagle3, peagle or dflash" >&2; exit 2 ;;
  esac
  run=$work/fam_$d
  rm -rf "$run" "$work/fam_eval_$d"
  t0=$SECONDS
  $T train "${common[@]}" "${extra[@]}" --out "$run" > "$work/fam_train_$d.log" 2>&1 ||
    { echo "$d: train failed: $(tail -2 "$work/fam_train_$d.log")"; continue; }
  echo "== $d: trained in $((SECONDS - t0)) s; $(grep -E "train complete" "$work/fam_train_$d.log" | tail -1)"
  $T eval --model "$gguf" --draft "$run" --data "$work/dev/mt_bench.jsonl" "$work/dev/alpaca80.jsonl" \
    "$work/dev/humaneval.jsonl" --max-new-tokens "$MAX_NEW" --chain "$CHAINS" --no-tree --temperatures 0 \
    --device "$eval_device" --out "$work/fam_eval_$d" > "$work/fam_eval_$d.log" 2>&1 ||
    echo "$d: eval failed: $(tail -2 "$work/fam_eval_$d.log")"
done
python3 - "$work" "$families" <<'PY'
import json, os, sys
work, fams = sys.argv[1], sys.argv[2].split(",")
print("| drafter | held-back acc_0 | held-back sim tau | config | dev tau (mt / alpaca / humaneval / all) "
      "| speedup (all) | greedy equal | train tok/s |")
print("|---|---|---|---|---|---|---|---|")
for d in fams:
    mpath = f"{work}/fam_{d}/metrics.jsonl"
    if not os.path.exists(mpath):
        print(f"| {d} | - | - | - | - | - | - | - |")
        continue
    rows = [json.loads(l) for l in open(mpath) if l.strip()]
    evals = [r for r in rows if r.get("split") == "eval"]
    trains = [r for r in rows if r.get("split") != "eval" and "tokens_per_s" in r]
    last = evals[-1] if evals else {}
    acc0 = f'{last["acc"][0]:.3f}' if last.get("acc") else "-"
    sim = f'{last["sim_accept_len"]:.3f}' if "sim_accept_len" in last else "-"
    tps = f'{trains[-1]["tokens_per_s"]:.0f}' if trains else "-"
    epath = f"{work}/fam_eval_{d}/eval.json"
    if not os.path.exists(epath):
        print(f"| {d} | {acc0} | {sim} | - | - | - | - | {tps} |")
        continue
    res = json.load(open(epath))["results"]
    configs = []
    for r in res:
        if r["config"] not in configs:
            configs.append(r["config"])
    for c in configs:
        by = {r["category"]: r for r in res if r["config"] == c}
        taus = " / ".join(f'{by[k]["speculative"]["tau"]:.2f}' if k in by else "-"
                          for k in ("mt_bench", "alpaca80", "humaneval", "all"))
        a = by.get("all", {})
        g = a.get("greedy_equal", {})
        eq = f'{g.get("compared", 0) - g.get("differ", 0)}/{g.get("compared", 0)}' if g else "-"
        sp = f'{a["speedup"]:.2f}x' if "speedup" in a else "-"
        print(f"| {d} | {acc0} | {sim} | {c} | {taus} | {sp} | {eq} | {tps} |")
PY
