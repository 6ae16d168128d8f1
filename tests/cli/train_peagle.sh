#!/usr/bin/env bash
# talon train --drafter peagle (CPU) end to end on SmolLM2 features of the demo chats:
# per-depth metrics and a held-back evaluation over every chain; a stopped run resumes to
# the same losses bit for bit; the export loads strictly in speculators 0.9.0 and its
# forward reproduces Talon's held-back loss (check_peagle_export.py); inspect and eval
# (parallel drafting, greedy equal to target-only decoding) read it; misuse is refused.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
demo_features "$WORK" && ok "features extracted" || bad "prepare + extract"
base=(--data "$WORK/feat" --model "$GGUF" --draft-vocab 256 --max-length 128 --ttt-steps 3 --max-steps 6 --epochs 2
      --save-every 2 --lr 1e-3 --batch-samples 2 --seed 5)
args=(--drafter peagle "${base[@]}")

"$TALON" train "${args[@]}" --out "$WORK/ref" > /dev/null 2> "$WORK/ref.err" && ok "uninterrupted P-EAGLE run" \
  || bad "train: $(tail -3 "$WORK/ref.err")"
grep -q "P-EAGLE: 3 depths, mask token 49151" "$WORK/ref.err" && ok "mask token: the highest id the data never uses" \
  || bad "mask token: $(grep P-EAGLE "$WORK/ref.err")"
python3 - "$WORK/ref/metrics.jsonl" <<'PY' && ok "6 train lines and one held-back line, 3 depths each" || bad "metrics: $(cat "$WORK/ref/metrics.jsonl")"
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in lines if "split" not in r]
ev = [r for r in lines if r.get("split") == "eval"]
assert [r["step"] for r in rows] == list(range(6)), rows
assert len(ev) == 1 and ev[0]["step"] == 6 and ev[0]["samples"] == 1, ev
for r in rows + ev:
    assert math.isfinite(r["loss"]) and len(r["acc"]) == 3 and len(r["cond_acc"]) == 3 and r["sim_accept_len"] >= 1, r
assert sum(r["loss"] > 0 for r in rows) >= 4 and all(r["grad_norm"] >= 0 for r in rows), rows
PY
ref=$(losses "$WORK/ref/metrics.jsonl")

stop_resume_checked "$WORK/hook" "$ref" " (COD draws included)" "${args[@]}"
"$TALON" train "${base[@]}" --out "$WORK/hook" > /dev/null 2> "$WORK/other.err"
[ $? -ne 0 ] && grep -q "belongs to a different training job.*drafter" "$WORK/other.err" \
  && ok "an EAGLE-3 run does not resume a P-EAGLE checkpoint" || bad "other drafter: $(tail -2 "$WORK/other.err")"

# Export: both dtypes, checked in speculators against the run's own held-back loss.
eval_loss=$(python3 -c "import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]['loss_exact'])" "$WORK/ref/metrics.jsonl")
for dt in fp32 bf16; do
  if "$TALON" export --checkpoint "$WORK/ref" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct \
       --format speculators --dtype $dt --speculative-tokens 3 --out "$WORK/x-$dt" > "$WORK/e.out" 2> "$WORK/e.err"; then
    msg=$(python3 "$SRC/tests/cli/check_peagle_export.py" "$WORK/ref/checkpoint.safetensors" "$WORK/x-$dt" $dt "$GGUF" \
            "$WORK/feat" 128 "$eval_loss" 2>&1) && ok "$(echo "$msg" | tail -1)" || bad "$dt: $(echo "$msg" | tail -3)"
  else
    bad "export $dt: $(tail -3 "$WORK/e.err")"
  fi
done
grep -q '"parallel_drafting": true, "num_speculative_tokens": 3' "$WORK/e.out" \
  && ok "export prints vLLM's parallel-drafting serve command" || bad "serve command: $(cat "$WORK/e.out")"
"$TALON" export --checkpoint "$WORK/ref" --model "$GGUF" --verifier org/x --format sglang --out "$WORK/x-sg" > /dev/null 2> "$WORK/sg.err"
[ $? -ne 0 ] && grep -q "exports in the speculators format only" "$WORK/sg.err" && [ ! -e "$WORK/x-sg" ] \
  && ok "--format sglang refused, nothing written" || bad "sglang: $(tail -2 "$WORK/sg.err")"
"$TALON" export --checkpoint "$WORK/ref" --model "$GGUF" --verifier org/x --speculative-tokens 5 --format speculators --out "$WORK/x-5" \
  > /dev/null 2> "$WORK/k5.err"
[ $? -ne 0 ] && grep -q "more than the 3 draft positions" "$WORK/k5.err" && ok "--speculative-tokens beyond the trained depths refused" \
  || bad "k5: $(tail -2 "$WORK/k5.err")"
"$TALON" inspect "$WORK/x-bf16" > "$WORK/i.out" 2>&1 && grep -q "P-EAGLE (parallel drafting), mask token 49151" "$WORK/i.out" \
  && grep -q "parallel_drafting" "$WORK/i.out" && ok "inspect reads the P-EAGLE export" || bad "inspect: $(cat "$WORK/i.out")"

# eval: one parallel step per round, from the checkpoint and from the export.
python3 - "$WORK/chats.jsonl" <<'PY'
import json, sys
qs = ["Name three colors.", "What is 2 + 2?", "Write a haiku about rain."]
with open(sys.argv[1], "w") as f:
    for q in qs:
        f.write(json.dumps({"conversations": [{"role": "user", "content": q}]}) + "\n")
PY
# bench/families_peer.py (the peer of the families' training speed: speculators' own model and
# training step) runs on the export's shape.
out=$(python3 "$SRC/bench/families_peer.py" "$WORK/x-fp32" --tokens 128 --steps 1 --warmup 0 --device cpu 2>/dev/null | tail -n 1)
python3 -c "import json, sys; d = json.loads(sys.argv[1]); assert d['family'] == 'peagle' and d['tokens_per_s'] > 0" "$out" \
  && ok "bench/families_peer.py trains speculators' P-EAGLE model on the export's shape" || bad "peer: $out"
for d in "$WORK/ref" "$WORK/x-fp32"; do
  "$TALON" eval --model "$GGUF" --data "$WORK/chats.jsonl" --max-new-tokens 16 --chain 3 --draft "$d" \
    --out "$WORK/ev-$(basename "$d")" > "$WORK/ev.out" 2> "$WORK/ev.err" || bad "eval $d: $(tail -3 "$WORK/ev.err")"
  python3 - "$WORK/ev-$(basename "$d")/eval.json" <<'PY' && ok "eval $(basename "$d"): greedy P-EAGLE chains equal target-only decoding" || bad "eval.json $d"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
assert rows
for r in rows:
    assert r["greedy_equal"]["differ"] == 0 and r["greedy_equal"]["compared"] == r["turns"] > 0, r
    assert len(r["speculative"]["accept_rate_per_depth"]) == 3 and r["speculative"]["tau"] >= 1.0, r
PY
done
grep -q "P-EAGLE draft" "$WORK/ev.err" && ok "eval names the drafter family" || bad "eval log: $(head -5 "$WORK/ev.err")"
"$TALON" eval --model "$GGUF" --data "$WORK/chats.jsonl" --max-new-tokens 8 --tree "3,3,6" --draft "$WORK/ref" \
  --out "$WORK/ev-tree" > /dev/null 2> "$WORK/tree.err"
[ $? -ne 0 ] && grep -q "drafts one chain per round" "$WORK/tree.err" && ok "a tree with a P-EAGLE draft is refused" \
  || bad "tree: $(tail -2 "$WORK/tree.err")"
finish
