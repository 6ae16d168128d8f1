#!/usr/bin/env bash
# On the GPU machine: SmolLM2 drafter from answers the target regenerated itself at T > 0 over
# every prompt and conversation of ../shared/data/train, then prepare, extract, train and a
# chain-3 `talon eval` on dev subsets. Every stage resumes (generate) or restarts cleanly, and
# each has a time limit so one call can do part of the job and the next continues.
#   bench/regen_smollm2_gpu.sh GGUF TRAIN_DIR DEV_DIR WORK [STAGES]
# Environment: SEED (sampling seed, 1), GEN_SECONDS (limit of the generate stage, 600),
# EPOCHS (2), VD (8192), TTT (7), EVAL_N (16 prompts per dev set).
set -uo pipefail
cd "$(dirname "$0")/.."
gguf=$1 train=$2 dev=$3 work=$4 stages=${5:-gen,prep,extract,train,eval}
T=${TALON:-build/talon}
SEED=${SEED:-1} GEN_SECONDS=${GEN_SECONDS:-600} EPOCHS=${EPOCHS:-2} VD=${VD:-8192} TTT=${TTT:-7} EVAL_N=${EVAL_N:-16}
mkdir -p "$work"
want() { [[ ",$stages," == *",$1,"* ]]; }
timed() { local name=$1; shift; local t0=$SECONDS; "$@"; echo "== $name: $((SECONDS - t0)) s"; }
gen=$work/gen_s$SEED
if want gen; then
  timed generate timeout --foreground -s INT "$GEN_SECONDS" $T generate --model "$gguf" --data "$train/sharegpt_1k" \
    "$train/ultrachat_eval" "$train/mt_bench_101" "$train/self_instruct" "$train/gsm8k" --out "$gen" \
    --device cuda:0 --batch 256 --max-new-tokens 1024 --max-len 2048 --temperature 0.7 --top-p 0.95 \
    --seed "$SEED" 2>&1 | grep -v "no room under\|no user turn" | tail -3
  if [ ! -f "$gen/generated.jsonl" ] && [ -f "$gen/progress.jsonl" ]; then
    # Stopped by the time limit: the finished conversations (the journal's kept lines, less
    # their index) feed the later stages; a rerun of this stage resumes the job.
    python3 - "$gen/progress.jsonl" "$work/gen_s${SEED}_partial.jsonl" <<'PY'
import json, sys
n = 0
with open(sys.argv[2], "w") as f:
    for line in open(sys.argv[1]):
        if not line.strip():
            continue
        j = json.loads(line)
        if j.get("skipped"):
            continue
        j.pop("index", None)
        f.write(json.dumps(j) + "\n")
        n += 1
print(f"  {n} finished conversations -> {sys.argv[2]}")
PY
  fi
fi
# prepare reads the whole job's output, or what a stopped job finished.
gen_out=$gen/generated.jsonl
[ -f "$gen_out" ] || gen_out=$work/gen_s${SEED}_partial.jsonl
if want prep; then
  rm -rf "$work/tok"
  timed prepare $T prepare --model "$gguf" --data "$gen_out" --out "$work/tok" --max-length 2048 2>&1 | tail -2
fi
if want extract; then
  rm -rf "$work/feat"
  timed extract $T extract --model "$gguf" --data "$work/tok" --out "$work/feat" --device cuda 2>&1 | tail -2
fi
if want train; then
  rm -rf "$work/run" "$work/run.sglang"
  timed train $T train --data "$work/feat" --model "$gguf" --out "$work/run" --device cuda --draft-vocab "$VD" \
    --max-length 2048 --ttt-steps "$TTT" --epochs "$EPOCHS" --lr 1e-3 --schedule cosine --clip 0.5 \
    --eval-fraction 0.02 --seed 1 --save-every 1000000 2>&1 | grep -E "eval after|tokens/s" | tail -3
  $T export --checkpoint "$work/run" --model "$gguf" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format sglang --out "$work/run.sglang" > /dev/null 2>&1
fi
if want eval; then
  mkdir -p "$work/dev"
  python3 - "$dev" "$work/dev" "$EVAL_N" <<'PY'
import json, sys
src, dst, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
for name, path, keep in [("mt_bench", "mt_bench/question.jsonl", ("question_id", "turns")),
                         ("alpaca80", "alpaca80/question.jsonl", ("question_id", "turns")),
                         ("humaneval", "humaneval/HumanEval.jsonl", ("task_id", "prompt"))]:
    rows = [json.loads(l) for l in open(f"{src}/{path}") if l.strip()]
    step = max(1, len(rows) // n)
    with open(f"{dst}/{name}.jsonl", "w") as f:
        for r in rows[::step][:n]:
            f.write(json.dumps({**{k: r[k] for k in keep}, "category": name}) + "\n")
PY
  rm -rf "$work/eval"
  timed eval $T eval --model "$gguf" --draft "$work/run.sglang" --data "$work/dev/mt_bench.jsonl" \
    "$work/dev/alpaca80.jsonl" "$work/dev/humaneval.jsonl" --max-new-tokens 128 --chain 3 --tree "6,8,32" \
    --temperatures 0 --device cuda:0 --out "$work/eval" 2>&1 | tail -16
fi
