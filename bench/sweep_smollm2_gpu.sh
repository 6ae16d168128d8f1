#!/usr/bin/env bash
# On the GPU machine: SmolLM2 drafters from data the target regenerated itself, several data
# mixes and recipes side by side, each evaluated where it is served (`talon eval` on dev
# subsets and on training-distribution prompts), then one `talon report` over all runs.
#   bench/sweep_smollm2_gpu.sh GGUF TRAIN_DIR DEV_DIR WORK STAGES
# STAGES, comma-separated, run in this order:
#   gen:NAME:TEMP:SEED:SECONDS  regenerate every conversation of TRAIN_DIR (sharegpt_1k,
#                               ultrachat_eval, mt_bench_101, self_instruct, then gsm8k) at
#                               temperature TEMP (top-p 0.95), at most SECONDS (resumes: run it
#                               again to continue); output WORK/gen_NAME (mix takes the finished
#                               conversations of a stopped one)
#   mix:NAME:GEN+GEN...         prepare + extract the union of those generations: WORK/feat_NAME
#   train:RUN:MIX:EPOCHS:VD:LR:TTT:NOISE   train WORK/run_RUN on WORK/feat_MIX, export (sglang)
#   eval:RUN                    chain-3 and tree d6 k8 n32 at T=0 on EVAL_N prompts per dev set,
#                               and chain-3 on EVAL_N prompts per training source (the
#                               distribution the draft was trained on)
#   report                      `talon report` over every WORK/run_* (one chart per metric)
# Results are copied to $OUT (metrics, eval.json, report) when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/.."
gguf=$1 train=$2 dev=$3 work=$4 stages=$5
T=${TALON:-build/talon}
EVAL_N=${EVAL_N:-16} BATCH=${BATCH:-512} EVAL_EVERY=${EVAL_EVERY:-2000}
# TRAIN_SECS: stop each training run (SIGINT: it drains and saves) after this many seconds.
mkdir -p "$work"
timed() { local name=$1; shift; local t0=$SECONDS; "$@"; echo "== $name: $((SECONDS - t0)) s"; }
sources=("$train/sharegpt_1k" "$train/ultrachat_eval" "$train/mt_bench_101" "$train/self_instruct" "$train/gsm8k")

dev_subsets() {
  mkdir -p "$work/evalsets"
  python3 - "$dev" "$train" "$work/evalsets" "$EVAL_N" <<'PY'
import json, sys
dev, train, dst, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
def pick(rows, n):
    step = max(1, len(rows) // n)
    return rows[::step][:n]
for name, path, keep in [("mt_bench", "mt_bench/question.jsonl", ("question_id", "turns")),
                         ("alpaca80", "alpaca80/question.jsonl", ("question_id", "turns")),
                         ("humaneval", "humaneval/HumanEval.jsonl", ("task_id", "prompt"))]:
    rows = [json.loads(l) for l in open(f"{dev}/{path}") if l.strip()]
    with open(f"{dst}/dev_{name}.jsonl", "w") as f:
        for r in pick(rows, n):
            f.write(json.dumps({**{k: r[k] for k in keep}, "category": name}) + "\n")
# Training-distribution prompts: first user turns of training records (trained on).
for name, path in [("sharegpt", "sharegpt_1k/sharegpt_1k.jsonl"), ("gsm8k", "gsm8k/train.jsonl")]:
    rows = [json.loads(l) for l in open(f"{train}/{path}") if l.strip()]
    out = []
    for r in pick(rows, n):
        if "question" in r:
            out.append({"question_id": len(out), "turns": [r["question"]], "category": "train_" + name})
        else:
            conv = r.get("conversations") or r.get("messages") or []
            first = next((m.get("value") or m.get("content") for m in conv
                          if (m.get("from") or m.get("role")) in ("human", "user")), None)
            if first:
                out.append({"question_id": len(out), "turns": [first], "category": "train_" + name})
    with open(f"{dst}/train_{name}.jsonl", "w") as f:
        for r in out:
            f.write(json.dumps(r) + "\n")
PY
}

IFS=, read -ra list <<< "$stages"
for st in "${list[@]}"; do
  IFS=: read -ra a <<< "$st"
  case ${a[0]} in
    gen)
      name=${a[1]} temp=${a[2]} seed=${a[3]} secs=${a[4]}
      timed "generate $name" timeout --foreground -s INT "$secs" $T generate --model "$gguf" --data "${sources[@]}" \
        --out "$work/gen_$name" --device cuda:0 --batch "$BATCH" --max-new-tokens 1024 --max-len 2048 \
        --temperature "$temp" --top-p 0.95 --seed "$seed" 2>&1 | grep -v "no room under\|no user turn" | tail -3
      ;;
    mix)
      name=${a[1]} files=()
      IFS=+ read -ra gens <<< "${a[2]}"
      for g in "${gens[@]}"; do
        # A generation stopped by its time limit has only its journal: take its finished,
        # kept conversations (the messages of each journal line).
        if [ ! -f "$work/gen_$g/generated.jsonl" ]; then
          python3 - "$work/gen_$g/progress.jsonl" "$work/gen_$g/partial.jsonl" <<'PY'
import json, sys
n = 0
with open(sys.argv[2], "w") as out:
    for line in open(sys.argv[1]):
        if not line.endswith("\n"):
            break
        j = json.loads(line)
        if not j.get("skipped"):
            out.write(json.dumps({"messages": j["messages"]}) + "\n")
            n += 1
print(f"{sys.argv[1]}: {n} finished conversations")
PY
          files+=("$work/gen_$g/partial.jsonl")
        else
          files+=("$work/gen_$g/generated.jsonl")
        fi
      done
      rm -rf "$work/tok_$name" "$work/feat_$name"
      timed "prepare $name" $T prepare --model "$gguf" --data "${files[@]}" --out "$work/tok_$name" --max-length 2048 2>&1 | tail -2
      timed "extract $name" $T extract --model "$gguf" --data "$work/tok_$name" --out "$work/feat_$name" --device cuda 2>&1 | tail -1
      ;;
    train)
      run=${a[1]} mix=${a[2]} ep=${a[3]} vd=${a[4]} lr=${a[5]} ttt=${a[6]} noise=${a[7]}
      rm -rf "$work/run_$run" "$work/run_$run.sglang"
      timed "train $run" ${TRAIN_SECS:+timeout -s INT "$TRAIN_SECS"} $T train --data "$work/feat_$mix" --model "$gguf" --out "$work/run_$run" --device cuda \
        --draft-vocab "$vd" --max-length 2048 --ttt-steps "$ttt" --epochs "$ep" --lr "$lr" --schedule cosine \
        --clip 0.5 --noise "$noise" --eval-fraction 0.02 --eval-every "$EVAL_EVERY" --seed 1 --save-every 1000000 \
        > "$work/run_$run.log" 2>&1
      grep -E "eval after| E |error|^== " "$work/run_$run.log" | tail -3
      $T export --checkpoint "$work/run_$run" --model "$gguf" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format sglang --out "$work/run_$run.sglang" > /dev/null 2>&1
      ;;
    eval)
      run=${a[1]}
      [ -f "$work/evalsets/dev_mt_bench.jsonl" ] || dev_subsets
      rm -rf "$work/eval_$run" "$work/evaltrain_$run"
      timed "eval dev $run" $T eval --model "$gguf" --draft "$work/run_$run.sglang" --data "$work/evalsets/dev_mt_bench.jsonl" \
        "$work/evalsets/dev_alpaca80.jsonl" "$work/evalsets/dev_humaneval.jsonl" --max-new-tokens 128 --chain 3 \
        --tree "6,8,32" --temperatures 0 --device cuda:0 --out "$work/eval_$run" 2>&1 | tail -14
      timed "eval train-dist $run" $T eval --model "$gguf" --draft "$work/run_$run.sglang" \
        --data "$work/evalsets/train_sharegpt.jsonl" "$work/evalsets/train_gsm8k.jsonl" --max-new-tokens 128 \
        --chain 3 --no-tree --temperatures 0 --device cuda:0 --out "$work/evaltrain_$run" 2>&1 | tail -8
      ;;
    report)
      runs=("$work"/run_*/)
      args=()
      for r in "${runs[@]}"; do args+=(--run "${r%/}"); done
      $T report "${args[@]}" --out "$work/report.html" 2>&1 | tail -2
      ;;
    *) echo "unknown stage $st"; exit 2 ;;
  esac
done
# The device returns only a few files from $OUT: everything goes into one archive.
if [ -n "${OUT:-}" ]; then
  (cd "$work" && tar czf "$OUT/sweep.tgz" --ignore-failed-read run_*/metrics.jsonl run_*.log \
     eval_*/eval.json evaltrain_*/eval.json gen_*/manifest.json report.html 2>/dev/null)
fi
exit 0
