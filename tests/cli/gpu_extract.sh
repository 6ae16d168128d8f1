#!/usr/bin/env bash
# GPU extraction end to end (exits 77 = skipped where there is no CUDA device):
#  * --device cuda reproduces the CPU dataset on SmolLM2 within the bf16 model tolerance;
#  * data parallel over two GPUs writes byte-identical shards to one GPU;
#  * a plan that does not fit fails before loading, with a --max-batch-tokens that fits;
#  * `talon gpus` shows the run holding its GPU; SIGINT stops it within seconds, the
#    process and its GPU memory are gone, and the rerun resumes to the same bytes.
source "$(dirname "$0")/lib.sh"
"$TALON" gpus 2> /dev/null | grep -q '^cuda:' || { echo "skip: no CUDA device"; exit 77; }
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "skip: missing $GGUF (run scripts/fetch_model.sh)"; exit 77; }
NGPU=$("$TALON" gpus | grep -c '^cuda:')
export TALON_RUNS_DIR="$WORK/runs"

tokens 12 49152 3 150 > "$WORK/small.jsonl"
"$TALON" extract --model "$GGUF" --data "$WORK/small.jsonl" --out "$WORK/cpu" --fp32 --device cpu > /dev/null 2>&1 || bad "cpu run failed"
"$TALON" extract --model "$GGUF" --data "$WORK/small.jsonl" --out "$WORK/gpu" --fp32 --device cuda:0 \
  --max-batch-tokens 1024 > /dev/null 2> "$WORK/gpu.err" && ok "cuda extract" || bad "cuda run failed: $(tail -3 "$WORK/gpu.err")"
python3 - "$WORK/cpu" "$WORK/gpu" "$SRC/tests/tolerances.h" <<'PY' && ok "cuda dataset == cpu dataset within kCudaModelRel" || bad "cuda vs cpu dataset"
import json, re, sys
import numpy as np
from safetensors.numpy import load_file
tol = float(re.search(r"kCudaModelRel = ([0-9.e-]+)", open(sys.argv[3]).read()).group(1))
a, b = (json.load(open(d + "/manifest.json")) for d in sys.argv[1:3])
assert [s["tokens"] for s in a["shards"]] == [s["tokens"] for s in b["shards"]]
for sa, sb in zip(a["shards"], b["shards"]):
    x, y = load_file(sys.argv[1] + "/" + sa["file"]), load_file(sys.argv[2] + "/" + sb["file"])
    for k in ("input_ids", "loss_mask", "sample_offsets", "sample_index"):
        assert (x[k] == y[k]).all(), k
    for k in ("aux_hidden_states", "hidden_states"):
        H = a["hidden_size"]
        for j in range(x[k].shape[1] // H):  # each captured layer separately
            p, q = x[k][:, j * H:(j + 1) * H], y[k][:, j * H:(j + 1) * H]
            assert np.isfinite(q).all(), k
            err = float(np.abs(p - q).max() / max(1.0, np.abs(p).max()))
            row = np.abs(p - q).max(axis=1) / np.maximum(1.0, np.abs(p).max(axis=1))
            print(f"{sa['file']} {k}[{j}]: max rel err {err:.2e} (limit {tol}); per row: median {np.median(row):.2e}, "
                  f"max {row.max():.2e}; |h| max {np.abs(p).max():.1f}")
            assert err <= tol, (k, j, err)
PY

# Memory plan: an impossible token budget fails before any weight is uploaded.
"$TALON" extract --model "$GGUF" --data "$WORK/small.jsonl" --out "$WORK/oom" --device cuda:0 \
  --max-batch-tokens 2000000000 > /dev/null 2> "$WORK/oom.err"
rc=$?
if [ $rc -ne 0 ] && grep -q "the run needs .* but only .* is free; try --max-batch-tokens [0-9]" "$WORK/oom.err" \
   && ! grep -q "uploaded" "$WORK/oom.err"; then ok "over-budget plan refused before loading: $(grep -o 'try --max.*' "$WORK/oom.err")"
else bad "over-budget plan: rc $rc $(tail -2 "$WORK/oom.err")"; fi

# Longer job: reference, then SIGINT + resume.
tokens 400 49152 5 600 > "$WORK/big.jsonl"
args=(--model "$GGUF" --data "$WORK/big.jsonl" --shard-tokens 20000 --max-batch-tokens 8192)
"$TALON" extract "${args[@]}" --device cuda:0 --out "$WORK/ref" > /dev/null 2>&1 && ok "reference gpu run" || bad "reference gpu run failed"
if [ "$NGPU" -ge 2 ]; then
  "$TALON" extract "${args[@]}" --device cuda:0,1 --out "$WORK/dp" > /dev/null 2> "$WORK/dp.err"
  grep -q "x 2 data-parallel" "$WORK/dp.err" && ok "dp run used 2 replicas" || bad "dp: $(grep loaded "$WORK/dp.err")"
  diff -r -x .talon.lock -x manifest.json "$WORK/ref" "$WORK/dp" > "$WORK/dpdiff" && ok "dp=2 shards byte-identical to one GPU" \
    || bad "dp shards differ: $(head -3 "$WORK/dpdiff")"
else echo "skip - data parallel (1 GPU)"; fi
"$TALON" --log-level debug extract "${args[@]}" --device cuda:0 --out "$WORK/int" > /dev/null 2> "$WORK/int.err" &
pid=$!
wait_recorded "$WORK/int/manifest.json" 1 1200 0.02
"$TALON" gpus > "$WORK/gpus.out" 2>&1
grep -qE "pid +$pid +[0-9]+ MiB +talon extract" "$WORK/gpus.out" && ok "talon gpus shows pid $pid holding GPU memory" \
  || echo "note - talon gpus did not attribute memory (container PID namespace?): $(cat "$WORK/gpus.out")"
kill -INT $pid
t0=$(date +%s.%N)
wait $pid; rc=$?
dt=$(python3 -c "print(f'{$(date +%s.%N) - $t0:.2f}')")
if [ $rc -eq 130 ] && grep -q "resume with:" "$WORK/int.err"; then ok "SIGINT: exit 130 after ${dt}s with a resume hint"
elif [ $rc -eq 0 ]; then ok "SIGINT arrived after the last shard"
else bad "SIGINT: rc $rc: $(tail -2 "$WORK/int.err")"; fi
grep -q "gpu 0\]" "$WORK/int.err" && ok "rank-tagged log lines ([gpu 0])" || bad "no [gpu 0] log lines"
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | grep -qw "$pid" && bad "pid $pid still holds GPU memory" \
    || ok "after exit pid $pid holds no GPU memory"
fi
"$TALON" extract "${args[@]}" --device cuda:0 --out "$WORK/int" > /dev/null 2>&1
diff -r -x .talon.lock "$WORK/ref" "$WORK/int" > "$WORK/diff" && ok "SIGINT + resume == uninterrupted (byte-identical)" \
  || bad "resumed differs: $(head -3 "$WORK/diff")"
finish
