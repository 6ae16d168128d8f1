#!/usr/bin/env bash
# On the GPU machine: the SmolLM2 training pipeline end to end on one GPU, and the GPU
# trainer against the CPU one on real features.
#   bench/train_smollm2_gpu.sh GGUF TOKENS_DIR WORK_DIR [MAX_STEPS]
# TOKENS_DIR: `talon prepare` output of ../shared/data/train for SmolLM2.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$1 tok=$2 work=$3 steps=${4:-600}
T=build/talon
mkdir -p "$work"
echo "== parity: CPU vs GPU (f32) training on the demo chats, 4 steps"
$T prepare --model "$gguf" --data examples/demo_chats.jsonl --out "$work/demo_tok" > /dev/null
$T extract --model "$gguf" --data "$work/demo_tok" --out "$work/demo_feat" --device cuda > /dev/null 2>&1
common=(--data "$work/demo_feat" --model "$gguf" --draft-vocab 4096 --max-length 256 --ttt-steps 7 --max-steps 4
        --batch-samples 2 --lr 1e-3 --eval-fraction 0.2 --seed 3)
$T train "${common[@]}" --device cpu --out "$work/par_cpu" 2> "$work/par_cpu.log"
$T train "${common[@]}" --device cuda --gpu-math f32 --out "$work/par_gpu" 2> "$work/par_gpu.log"
python3 - "$work/par_cpu/metrics.jsonl" "$work/par_gpu/metrics.jsonl" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
assert len(a) == len(b), (len(a), len(b))
worst = 0
for x, y in zip(a, b):
    assert x["step"] == y["step"] and x.get("split") == y.get("split")
    r = abs(x["loss"] - y["loss"]) / max(1, abs(x["loss"]))
    worst = max(worst, r)
    print(f'{x.get("split", "train")} step {x["step"]}: cpu {x["loss"]:.6f} gpu {y["loss"]:.6f} acc0 {x["acc"][0]:.3f}/{y["acc"][0]:.3f}')
print(f"parity: worst relative loss difference {worst:.2e} over {len(a)} records", "PASS" if worst < 1e-4 else "FAIL")
PY
echo "== extract the training set on the GPU"
/usr/bin/time -f "extract wall %e s, max RSS %M KB" $T extract --model "$gguf" --data "$tok" --out "$work/feat" --device cuda 2>&1 | tail -3
du -sh "$work/feat"
echo "== train on the GPU (bf16 tensor cores)"
/usr/bin/time -f "train wall %e s, max RSS %M KB" $T train --data "$work/feat" --model "$gguf" --out "$work/run" --device cuda \
  --draft-vocab 32000 --max-length 2048 --ttt-steps 7 --batch-samples 16 --max-batch-tokens 32768 --lr 3e-4 \
  --warmup-steps 30 --eval-fraction 0.02 --eval-every 100 --save-every 200 --max-steps "$steps" --seed 1 2>&1 | tail -12
python3 - "$work/run/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tr = [r for r in rows if "split" not in r]
ev = [r for r in rows if r.get("split") == "eval"]
for r in tr[:: max(1, len(tr) // 8)] + tr[-1:]:
    print(f'train step {r["step"]}: loss {r["loss"]:.4f} acc {" ".join(f"{a:.3f}" for a in r["acc"])} tau {r["sim_accept_len"]:.3f} {r["tokens_per_s"]:.0f} tok/s')
for r in ev:
    print(f'eval  step {r["step"]}: loss {r["loss"]:.4f} acc {" ".join(f"{a:.3f}" for a in r["acc"])} cond {" ".join(f"{a:.3f}" for a in r["cond_acc"])} tau {r["sim_accept_len"]:.3f}')
PY
