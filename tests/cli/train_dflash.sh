#!/usr/bin/env bash
# talon train --drafter dflash (CPU) end to end on SmolLM2 features of the demo chats: per-
# position metrics and a held-back evaluation over every anchor; a stopped run resumes to the
# same losses bit for bit; the export loads strictly in speculators 0.9.0 and its forward
# reproduces Talon's held-back loss (check_dflash_export.py), with speculators' recipe
# (cross-entropy, D-PACE) and with KL and fixed-exp-decay weights; inspect reads it; eval
# drafts a block per round with greedy output equal to the target's; misuse is refused.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
demo_features "$WORK" && ok "features extracted" || bad "prepare + extract"
base=(--data "$WORK/feat" --model "$GGUF" --draft-vocab 256 --max-length 128 --epochs 2 --save-every 2 --lr 1e-3
      --batch-samples 2 --seed 5)
args=(--drafter dflash --draft-layers 2 --block-size 4 --max-anchors 16 --max-steps 6 "${base[@]}")
last_loss() { python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['loss_exact'])" "$1"; }

"$TALON" train "${args[@]}" --out "$WORK/ref" > /dev/null 2> "$WORK/ref.err" && ok "uninterrupted DFlash run" \
  || bad "train: $(tail -3 "$WORK/ref.err")"
grep -q "DFlash: 2 layers, blocks of 4, mask token 49151, cross-entropy with D-PACE weights, up to 16 anchors" \
  "$WORK/ref.err" && ok "speculators' recipe by default (cross-entropy, D-PACE)" || bad "log: $(grep DFlash "$WORK/ref.err")"
python3 - "$WORK/ref/metrics.jsonl" <<'PY' && ok "6 train lines and one held-back line, 3 positions each" || bad "metrics: $(cat "$WORK/ref/metrics.jsonl")"
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in lines if "split" not in r]
ev = [r for r in lines if r.get("split") == "eval"]
assert [r["step"] for r in rows] == list(range(6)), rows
assert len(ev) == 1 and ev[0]["step"] == 6, ev
for r in rows + ev:
    assert math.isfinite(r["loss"]) and len(r["acc"]) == 3 and len(r["cond_acc"]) == 3 and r["sim_accept_len"] >= 1, r
assert rows[-1]["loss"] < rows[0]["loss"], [r["loss"] for r in rows]
PY
ref=$(losses "$WORK/ref/metrics.jsonl")

stop_resume_checked "$WORK/hook" "$ref" " (anchor draws included)" "${args[@]}"
"$TALON" train --drafter dflash --draft-layers 3 --block-size 4 --max-anchors 16 --max-steps 6 "${base[@]}" --out "$WORK/hook" \
  > /dev/null 2> "$WORK/other.err"
[ $? -ne 0 ] && grep -q "belongs to a different training job.*draft_layers" "$WORK/other.err" \
  && ok "another layer count does not resume this checkpoint" || bad "other job: $(tail -2 "$WORK/other.err")"

for dt in fp32 bf16; do
  if "$TALON" export --checkpoint "$WORK/ref" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct \
       --format speculators --dtype $dt --out "$WORK/x-$dt" > "$WORK/e.out" 2> "$WORK/e.err"; then
    msg=$(python3 "$SRC/tests/cli/check_dflash_export.py" "$WORK/ref/checkpoint.safetensors" "$WORK/x-$dt" $dt "$GGUF" \
            "$WORK/feat" 128 "$(last_loss "$WORK/ref/metrics.jsonl")" 2>&1) && ok "$(echo "$msg" | tail -1)" \
      || bad "$dt: $(echo "$msg" | tail -3)"
  else
    bad "export $dt: $(tail -3 "$WORK/e.err")"
  fi
done
grep -q '"method": "dflash", "num_speculative_tokens": 3' "$WORK/e.out" \
  && ok "export prints vLLM's DFlash serve command (block - 1 tokens)" || bad "serve command: $(cat "$WORK/e.out")"

# KL with fixed-exp-decay weights (the model's own defaults), checked the same way.
"$TALON" train --drafter dflash --draft-layers 1 --block-size 5 --max-anchors 8 --dflash-loss kl \
  --dflash-weighting fixed-exp-decay --dflash-gamma 2 "${base[@]}" --max-steps 3 --out "$WORK/kl" > /dev/null 2> "$WORK/kl.err" \
  || bad "train kl: $(tail -3 "$WORK/kl.err")"
"$TALON" export --checkpoint "$WORK/kl" --model "$GGUF" --verifier org/x --format speculators --dtype fp32 \
  --out "$WORK/x-kl" > /dev/null 2>&1 || bad "export kl"
msg=$(python3 "$SRC/tests/cli/check_dflash_export.py" "$WORK/kl/checkpoint.safetensors" "$WORK/x-kl" fp32 "$GGUF" \
        "$WORK/feat" 128 "$(last_loss "$WORK/kl/metrics.jsonl")" 2>&1) && ok "KL + fixed-exp-decay: $(echo "$msg" | tail -1)" \
  || bad "kl: $(echo "$msg" | tail -3)"

"$TALON" export --checkpoint "$WORK/ref" --model "$GGUF" --verifier org/x --format sglang --out "$WORK/x-sg" \
  > /dev/null 2> "$WORK/sg.err"
[ $? -ne 0 ] && grep -q "exports in the speculators format only" "$WORK/sg.err" && [ ! -e "$WORK/x-sg" ] \
  && ok "--format sglang refused, nothing written" || bad "sglang: $(tail -2 "$WORK/sg.err")"
"$TALON" inspect "$WORK/x-bf16" > "$WORK/i.out" 2>&1 && grep -q "DFlash (block drafter): 2 layers, blocks of 4" "$WORK/i.out" \
  && ok "inspect reads the DFlash export" || bad "inspect: $(cat "$WORK/i.out")"
# bench/families_peer.py (the peer of the families' training speed: speculators' own model and
# training step) runs on the export's shape.
out=$(python3 "$SRC/bench/families_peer.py" "$WORK/x-fp32" --tokens 128 --steps 1 --warmup 0 --device cpu 2>/dev/null | tail -n 1)
python3 -c "import json, sys; d = json.loads(sys.argv[1]); assert d['family'] == 'dflash' and d['tokens_per_s'] > 0" "$out" \
  && ok "bench/families_peer.py trains speculators' DFlash model on the export's shape" || bad "peer: $out"
# eval: one block per round (its first row the last verified token), greedy equal to the target.
python3 - "$WORK/chats.jsonl" <<'PY'
import json, sys
with open(sys.argv[1], "w") as f:
    for q in ["Name three colors.", "What is 2 + 2?"]:
        f.write(json.dumps({"conversations": [{"role": "user", "content": q}]}) + "\n")
PY
for d in "$WORK/ref" "$WORK/x-fp32"; do
  "$TALON" eval --model "$GGUF" --data "$WORK/chats.jsonl" --max-new-tokens 12 --chain 3,5 --draft "$d" \
    --out "$WORK/ev-$(basename "$d")" > /dev/null 2> "$WORK/ev.err" || bad "eval $d: $(tail -3 "$WORK/ev.err")"
  python3 - "$WORK/ev-$(basename "$d")/eval.json" <<'PY' && ok "eval $(basename "$d"): greedy DFlash blocks equal target-only decoding, chains capped at block - 1" || bad "eval.json $d"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
assert {r["config"] for r in rows} == {"chain-3", "chain-5"}, {r["config"] for r in rows}
for r in rows:
    assert r["greedy_equal"]["differ"] == 0 and r["greedy_equal"]["compared"] == r["turns"] > 0, r
    assert r["speculative"]["tau"] >= 1.0, r
PY
done
grep -q "DFlash draft" "$WORK/ev.err" && ok "eval names the drafter family" || bad "eval log: $(head -5 "$WORK/ev.err")"
"$TALON" eval --model "$GGUF" --data "$WORK/chats.jsonl" --max-new-tokens 4 --tree "3,3,6" --draft "$WORK/ref" \
  --out "$WORK/ev-tree" > /dev/null 2> "$WORK/tree.err"
[ $? -ne 0 ] && grep -q "is a DFlash draft, which drafts one chain per round" "$WORK/tree.err" \
  && ok "a tree with a DFlash draft is refused" || bad "tree: $(tail -2 "$WORK/tree.err")"
finish
