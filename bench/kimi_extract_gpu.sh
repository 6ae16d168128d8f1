#!/usr/bin/env bash
# Kimi-K2-shaped INT4 extraction with `talon extract --ep N`: the run issue 8 asks for on 8 GPUs
# (61 layers, captures 2,30,58 + h[61]), runnable with fewer layers on fewer GPUs. Weights are
# random and built in host memory (--model random:kimi-k2:LAYERS; no checkpoint on disk).
#   bench/kimi_extract_gpu.sh LAYERS EP TOKENS_JSONL [OUT]
# 1. a full run: load time, tokens/s, GPU memory per rank (nvidia-smi sampled every 0.5 s);
# 2. the same job started again in a fresh directory and sent SIGINT (to the PID this script
#    started, never by name) INTERRUPT_AFTER seconds (default 5) after the model is loaded, i.e.
#    mid-way through the forwards: it must exit with the resume hint,
#    and afterwards nvidia-smi must show every GPU back to its memory before the run;
# 3. the same command rerun: it resumes and completes, and its shards must equal run 1's
#    (SHA-256 from the manifests).
# Run from the repository root after scripts/gpu_build.sh.
set -uo pipefail
layers=${1:?layers} ep=${2:?ep} data=${3:?tokens jsonl} out=${4:-/tmp/kimi_extract}
devices=$(seq -s, 0 $((ep - 1)))
if [ "$layers" -eq 61 ]; then caps=(--layers 2,30,58); else caps=(); fi
rm -rf "$out"; mkdir -p "$out"
cmd() { build/talon extract --model "random:kimi-k2:$layers" --data "$data" --out "$1" --device "cuda:$devices" \
          --ep "$ep" --max-batch-tokens "${MAX_BATCH:-16384}" "${caps[@]}"; }
mem() { nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits | tr '\n' ' '; }
echo "GPU memory before: $(mem)"
base=$(mem)

echo "== 1. full run"
( while sleep 0.5; do mem; echo; done ) > "$out/mem.log" &
sampler=$!
cmd "$out/run1" > "$out/run1.log" 2>&1
rc=$?
kill "$sampler" 2>/dev/null
echo "exit $rc"
grep -E "loaded in|extract:|memory after load|weights on the device" "$out/run1.log" | sed 's/^/  /' | head -20
python3 - "$out/mem.log" <<'EOF'
import sys
peak = {}
for line in open(sys.argv[1]):
    parts = line.replace(",", " ").split()
    for i in range(0, len(parts) - 1, 2):
        peak[parts[i]] = max(peak.get(parts[i], 0), int(parts[i + 1]))
print("  peak GPU memory (MiB) per GPU:", peak)
EOF

echo "== 2. interrupted run (SIGINT ${INTERRUPT_AFTER:-5}s after the model is loaded)"
cmd "$out/run2" > "$out/run2a.log" 2>&1 &
pid=$!
for _ in $(seq 2400); do
  grep -q "loaded in" "$out/run2a.log" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.25
done
sleep "${INTERRUPT_AFTER:-5}"
kill -INT "$pid"
wait "$pid"
echo "exit $? after SIGINT"
grep -E "resume with|interrupt|stopp|signal|extract complete" "$out/run2a.log" | sed 's/^/  /' | head -5
sleep 2
echo "GPU memory after the interrupted run: $(mem) (before: $base)"

echo "== 3. resume"
cmd "$out/run2" > "$out/run2b.log" 2>&1
echo "exit $?"
grep -E "resum|extract:" "$out/run2b.log" | sed 's/^/  /' | head -5
python3 - "$out/run1" "$out/run2" <<'EOF'
import json, sys
a, b = (json.load(open(d + "/manifest.json")) for d in sys.argv[1:3])
sa = [s.get("sha256") for s in a["shards"]]
sb = [s.get("sha256") for s in b["shards"]]
print(f"  shards: run1 {len(sa)}, interrupted+resumed {len(sb)}; identical: {sa == sb}; status {b.get('status')}")
EOF
