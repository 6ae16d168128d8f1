#!/usr/bin/env bash
# talon train (CPU) end to end on SmolLM2 features of the demo chats: metrics
# are written per step; a run stopped (test hook) or killed with -9 and rerun logs the
# same losses, bit for bit, as an uninterrupted run; mismatched inputs are refused.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
demo_features "$WORK" && ok "features extracted" || bad "prepare + extract"
base=(--data "$WORK/feat" --model "$GGUF" --draft-vocab 256 --max-length 128 --ttt-steps 3 --max-steps 8 --epochs 2
      --save-every 2 --lr 1e-3 --warmup-steps 2 --batch-samples 2)
args=("${base[@]}" --seed 5)

"$TALON" train "${args[@]}" --out "$WORK/ref" > "$WORK/ref.out" 2> "$WORK/ref.err" && ok "uninterrupted run" || bad "train: $(tail -3 "$WORK/ref.err")"
python3 - "$WORK/ref/metrics.jsonl" <<'PY' && ok "8 train metric lines (loss, acc and cond_acc per TTT step, lr schedule, grad norm) and one eval line on the held-back split" || bad "metrics: $(head -2 "$WORK/ref/metrics.jsonl")"
import json, math, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
rows = [r for r in lines if "split" not in r]
ev = [r for r in lines if r.get("split") == "eval"]
assert [r["step"] for r in rows] == list(range(8)), rows
assert len(ev) == 1 and ev[0]["step"] == 8 and ev[0]["samples"] >= 1 and len(ev[0]["cond_acc"]) == 3, ev
assert lines[-1] is ev[0] or lines[-1] == ev[0], "the evaluation follows the last step"
for r in rows + ev:
    assert math.isfinite(r["loss"]) and len(r["acc"]) == 3 and len(r["cond_acc"]) == 3 and r["sim_accept_len"] >= 1, r
for r in rows:
    assert r["grad_norm"] >= 0, r
assert abs(rows[0]["lr"] - 0.5e-3) < 1e-12 and abs(rows[1]["lr"] - 1e-3) < 1e-12, rows[:2]  # warm-up
assert any(r["loss"] > 0 for r in rows)
PY
ref=$(losses "$WORK/ref/metrics.jsonl")

# Stop at a step boundary (as a signal would), then resume.
stop_resume_checked "$WORK/hook" "$ref" "" "${args[@]}"

# kill -9 after the first checkpoint.
"$TALON" train "${args[@]}" --out "$WORK/k9" > /dev/null 2>&1 &
pid=$!
for i in $(seq 1 1200); do [ -f "$WORK/k9/checkpoint.safetensors" ] && break; sleep 0.05; done
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
n=$(wc -l < "$WORK/k9/metrics.jsonl")
"$TALON" train "${args[@]}" --out "$WORK/k9" > /dev/null 2>&1
[ "$(losses "$WORK/k9/metrics.jsonl")" = "$ref" ] && ok "kill -9 (at $n logged steps) + resume: identical losses" \
  || bad "after kill -9: $(losses "$WORK/k9/metrics.jsonl") vs $ref"

# Run lifecycle: the run records itself in its directory's lock; a second run there is
# refused naming it; `talon stop DIR` signals exactly that PID, which checkpoints and exits
# with a resume hint; the rerun logs the uninterrupted run's losses.
export TALON_RUNS_DIR="$WORK/runs"
"$TALON" train "${args[@]}" --out "$WORK/st" > /dev/null 2> "$WORK/st.err" &
pid=$!
for i in $(seq 1 1200); do [ -f "$WORK/st/checkpoint.safetensors" ] && break; sleep 0.05; done
"$TALON" train "${args[@]}" --out "$WORK/st" > /dev/null 2> "$WORK/st2.err"
[ $? -ne 0 ] && grep -q "another talon run (pid $pid on .*) is writing this directory" "$WORK/st2.err" \
  && ok "a second train on the same --out is refused, naming pid $pid" || bad "second run: $(tail -2 "$WORK/st2.err")"
stop_checked "$WORK/st" $pid "$WORK/st.err" train 120
"$TALON" train "${args[@]}" --out "$WORK/st" > /dev/null 2>&1
[ "$(losses "$WORK/st/metrics.jsonl")" = "$ref" ] && ok "talon stop + resume: identical losses" \
  || bad "after talon stop: $(losses "$WORK/st/metrics.jsonl") vs $ref"

# Online: the target runs in-process on the prepare output; the features it makes are the
# ones extract wrote, so the losses are the same bits as training from disk.
small=(--model "$GGUF" --draft-vocab 256 --max-length 128 --ttt-steps 3 --max-steps 3 --batch-samples 2 --lr 1e-3 --seed 5)
"$TALON" train "${small[@]}" --online --data "$WORK/tok" --out "$WORK/online" > /dev/null 2> "$WORK/online.err" \
  || bad "online: $(tail -3 "$WORK/online.err")"
"$TALON" train "${small[@]}" --data "$WORK/feat" --out "$WORK/offline3" > /dev/null 2>&1 || bad "offline 3 steps"
grep -q "online: target .* feeds the trainer, aux layers \[2,15,27\] + final 30" "$WORK/online.err" \
  && [ "$(losses "$WORK/online/metrics.jsonl")" = "$(losses "$WORK/offline3/metrics.jsonl")" ] \
  && ok "online training (target in-process, no features on disk) logs the offline run's losses" \
  || bad "online vs offline: $(losses "$WORK/online/metrics.jsonl") vs $(losses "$WORK/offline3/metrics.jsonl")"
"$TALON" train "${base[@]}" --out "$WORK/x" --layers 1,2,3 > /dev/null 2> "$WORK/e3"
[ $? -ne 0 ] && grep -q "\-\-layers applies to \-\-online" "$WORK/e3" && ok "--layers without --online refused" || bad "$(cat "$WORK/e3")"
# The GPU engine's options are checked up front whatever the device, and change nothing on the
# CPU: --gpu-attention cudnn is a value the trainer takes (it once refused it).
"$TALON" train "${small[@]}" --data "$WORK/feat" --out "$WORK/cudnn-opt" --gpu-attention cudnn > /dev/null 2> "$WORK/e6" \
  && [ "$(losses "$WORK/cudnn-opt/metrics.jsonl")" = "$(losses "$WORK/offline3/metrics.jsonl")" ] \
  && ok "--gpu-attention cudnn is taken (on the CPU the losses do not change)" || bad "cudnn option: $(tail -3 "$WORK/e6")"
"$TALON" train "${base[@]}" --out "$WORK/x" --gpu-attention fastest > /dev/null 2> "$WORK/e4"
[ $? -ne 0 ] && grep -q "expected auto, cudnn, flash, blocks or loop" "$WORK/e4" && ok "--gpu-attention fastest refused, naming the values" \
  || bad "$(cat "$WORK/e4")"
"$TALON" train "${base[@]}" --out "$WORK/x" --gpu-batch-embeddings --gpu-device-embeddings > /dev/null 2> "$WORK/e5"
[ $? -ne 0 ] && grep -q "\-\-gpu-batch-embeddings and \-\-gpu-device-embeddings: choose one" "$WORK/e5" \
  && ok "--gpu-batch-embeddings with --gpu-device-embeddings refused" || bad "$(cat "$WORK/e5")"

# Hidden-state noise: seeded by (seed, step, slot), so it changes the losses but a stopped
# and resumed run still logs the uninterrupted run's bits.
noise=(--model "$GGUF" --data "$WORK/feat" --draft-vocab 256 --max-length 128 --ttt-steps 2 --max-steps 3 --batch-samples 2 --seed 5 --noise 0.5)
"$TALON" train "${noise[@]}" --out "$WORK/noise" > /dev/null 2>&1 || bad "noise run"
"$TALON" train "${noise[@]}" --out "$WORK/noise2" --stop-after-steps 1 > /dev/null 2>&1
"$TALON" train "${noise[@]}" --out "$WORK/noise2" > /dev/null 2>&1 || bad "noise resume"
"$TALON" train "${noise[@]:0:16}" --out "$WORK/quiet" > /dev/null 2>&1 || bad "no-noise run"
n1=$(losses "$WORK/noise/metrics.jsonl"); n2=$(losses "$WORK/noise2/metrics.jsonl"); q=$(losses "$WORK/quiet/metrics.jsonl")
[ "$n1" = "$n2" ] && [ "$n1" != "$q" ] && ok "--noise changes the losses; stop + resume with noise logs the same bits" \
  || bad "noise: $n1 / resumed $n2 / without $q"

# Refusals.
"$TALON" train "${base[@]}" --out "$WORK/k9" --seed 6 > /dev/null 2> "$WORK/e1"
[ $? -ne 0 ] && grep -q "belongs to a different training job (.*seed" "$WORK/e1" && ok "checkpoint of another job refused" || bad "$(cat "$WORK/e1")"
"$TALON" train --data "$WORK/feat" --model "$SRC/tests/fixtures/golden/llama_gqa" --out "$WORK/x" > /dev/null 2> "$WORK/e2"
[ $? -ne 0 ] && grep -q "features were extracted from a model with config sha256" "$WORK/e2" && ok "features of another target refused" || bad "$(cat "$WORK/e2")"
finish
