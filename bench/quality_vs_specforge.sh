#!/usr/bin/env bash
# Draft quality against a reference trainer (issue 22, part 1): Talon's EAGLE-3 trainer and
# SpecForge 0.2.0's own draft model, TTT loss and optimizer, trained on the same SmolLM2
# features, for several seeds, on one GPU.
#
#   bench/quality_vs_specforge.sh GGUF TRAIN_DIR DEV_DIR WORK [STAGES]
#
# GGUF: SmolLM2-135M-Instruct.Q4_1.gguf. TRAIN_DIR: ../shared/data/train (sharegpt_1k/,
# gsm8k/); DEV_DIR: ../shared/data/dev (mt_bench/, alpaca80/, humaneval/). WORK: scratch.
# STAGES: a comma-separated subset of data,prep,extract,train,heldout,eval,report (default all).
#
# Needs build/talon with the CUDA backend (TALON=... for another binary) and a python3 with
# torch, transformers, safetensors and specforge==0.2.0 (SF_SITE=DIR is put first on
# PYTHONPATH, e.g. after `pip install --no-deps --target DIR specforge-0.2.0-py3-none-any.whl`;
# the modules used import no SGLang code, so nothing is stubbed). Knobs (environment):
# SEEDS ("1 2 3"), EPOCHS (1), LR (1e-3), VD (8192), TTT (7), GSM8K (1200 first records),
# EVAL_N (16 questions per dev set), MAX_NEW (128), OUT (a folder that gets the results).
#
# On the GPU machine (one H200; the whole run takes about 7 minutes: training 190 s, the six
# `talon eval`s 180 s), after building talon from a committed snapshot (scripts/gpu_build.sh,
# or `ninja -C build talon` after its cmake line) and `pip install --no-deps --target
# /tmp/site specforge-0.2.0-py3-none-any.whl`:
#   SF_SITE=/tmp/site TALON=/tmp/s/build/talon OUT=$OUT bench/quality_vs_specforge.sh \
#       /tmp/smol.gguf /tmp/data/train /tmp/data/dev /tmp/q22
# The GGUF (98 MB) is over one call's transfer limit: it travels in two parts in two calls
# while the machine stays warm. To size EPOCHS before the features exist,
# `bench/quality_vs_specforge_ref.py speed --lengths L.json` times SpecForge's step on random
# weights of SmolLM2's shapes (H200: 81-102 ms a step, three processes side by side).
#
# What each side does (bench/quality_vs_specforge_ref.py has the details):
# * data: sharegpt_1k + the first $GSM8K gsm8k records with their own answers (no `generate`),
#   `talon prepare --max-length 2048`, one `talon extract --device cuda` (aux 2,15,27 + 30, bf16).
# * Talon: `talon train --device cuda` (bf16 math), Vd $VD, K=$TTT, decay 0.8, $EPOCHS epochs,
#   1 sample per step, lr $LR with a linear warm-up of 1.5% of the steps then cosine to 0,
#   clip 0.5, 5% held back; `talon export --format sglang`.
# * SpecForge: LlamaForCausalLMEagle3 (sdpa backend) in OnlineEagle3Model, its LogSoftmaxLoss,
#   Eagle3TrainStrategy (TargetHead shift, sum 0.8^k loss_k), BF16Optimizer (AdamW on fp32
#   masters, clip 0.5, the same warm-up steps and cosine), batch 1, torch.manual_seed(seed);
#   Talon's held-back split, per-epoch order and draft vocabulary for that seed; saved with
#   save_pretrained (no embedding) + apply_legacy_rope_scaling, i.e. SGLang's layout.
# * Both drafts: held-back acc_k / cond acc_k / simulated acceptance by one evaluator with
#   `talon train`'s definitions; `talon eval` (chain-3, T=0) on dev subsets, per set.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$1 train=$2 dev=$3 work=$4 stages=${5:-data,prep,extract,train,heldout,eval,report}
T=${TALON:-build/talon}
REF=$PWD/bench/quality_vs_specforge_ref.py
SEEDS=${SEEDS:-1 2 3} EPOCHS=${EPOCHS:-1} LR=${LR:-1e-3} VD=${VD:-8192} TTT=${TTT:-7}
GSM8K=${GSM8K:-1200} EVAL_N=${EVAL_N:-16} MAX_NEW=${MAX_NEW:-128}
export PYTHONPATH=${SF_SITE:+$SF_SITE:}${PYTHONPATH:-} TORCHDYNAMO_DISABLE=1 PYTHONUNBUFFERED=1
mkdir -p "$work/logs"
want() { [[ ",$stages," == *",$1,"* ]]; }
timed() { local name=$1; shift; local t0=$SECONDS; "$@"; echo "== $name: $((SECONDS - t0)) s"; }

if want data; then
  mkdir -p "$work/in" "$work/dev"
  cp "$train/sharegpt_1k/sharegpt_1k.jsonl" "$work/in/sharegpt_1k.jsonl"
  head -n "$GSM8K" "$train/gsm8k/train.jsonl" > "$work/in/gsm8k.jsonl"
  # Dev subsets spread over each file (mt_bench: every category), tagged with the set's name so
  # `talon eval` reports tau per set.
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
fi
if want prep; then
  rm -rf "$work/tok"
  timed prepare $T prepare --model "$gguf" --data "$work/in/sharegpt_1k.jsonl" "$work/in/gsm8k.jsonl" \
    --out "$work/tok" --max-length 2048 2>&1 | tail -2
fi
if want extract; then
  timed extract $T extract --model "$gguf" --data "$work/tok" --out "$work/feat" --device cuda 2>&1 | tail -2
fi

# The job's size: steps per seed and the warm-up (1.5% of the steps, SpecForge's default ratio).
eval "$(python3 "$REF" plan --feat "$work/feat" --epochs "$EPOCHS" --eval-fraction 0.05 --warmup-ratio 0.015 \
  2>/dev/null | sed 's/^/plan_/')" || true
if want train; then
  echo "plan: ${plan_samples:-?} samples, ${plan_train_samples:-?} trained on, ${plan_held_back:-?} held back," \
    "${plan_steps:-?} steps, warm-up ${plan_warmup:-?}"
  t0=$SECONDS
  pids=()
  for s in $SEEDS; do  # SpecForge: one process per seed, side by side on the GPU
    rm -rf "$work/sf_s$s" "$work/sf_s$s".*
    python3 "$REF" train --feat "$work/feat" --gguf "$gguf" --seed "$s" --out "$work/sf_s$s" --epochs "$EPOCHS" \
      --lr "$LR" --warmup "$plan_warmup" --draft-vocab "$VD" --ttt "$TTT" --eval-fraction 0.05 \
      > "$work/logs/sf_s$s.log" 2>&1 &
    pids+=($!)
  done
  (  # Talon: the seeds one after another, beside them
    for s in $SEEDS; do
      rm -rf "$work/talon_s$s" "$work/talon_s$s.sglang"
      t1=$SECONDS
      $T train --data "$work/feat" --model "$gguf" --out "$work/talon_s$s" --device cuda --draft-vocab "$VD" \
        --max-length 2048 --ttt-steps "$TTT" --epochs "$EPOCHS" --lr "$LR" --warmup-steps "$plan_warmup" \
        --schedule cosine --clip 0.5 --batch-samples 1 --eval-fraction 0.05 --seed "$s" --save-every 1000000 \
        > "$work/logs/talon_s$s.log" 2>&1
      echo "talon seed $s: $((SECONDS - t1)) s" >> "$work/logs/talon_times.log"
      $T export --checkpoint "$work/talon_s$s" --model "$gguf" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format sglang --out "$work/talon_s$s.sglang" \
        >> "$work/logs/talon_s$s.log" 2>&1
    done
  ) &
  pids+=($!)
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  cat "$work/logs/talon_times.log"
  for s in $SEEDS; do tail -n 1 "$work/logs/sf_s$s.log"; grep -h "eval after" "$work/logs/talon_s$s.log" || true; done
  echo "== train (both, side by side): $((SECONDS - t0)) s"
  [ $rc = 0 ] || { for s in $SEEDS; do tail -n 5 "$work/logs/sf_s$s.log" "$work/logs/talon_s$s.log"; done; exit 1; }
fi
if want heldout; then
  t0=$SECONDS
  pids=()
  for s in $SEEDS; do
    python3 "$REF" heldout --feat "$work/feat" --gguf "$gguf" --seed "$s" --ttt "$TTT" --eval-fraction 0.05 \
      --draft "$work/talon_s$s.sglang" "$work/sf_s$s" --json "$work/heldout_s$s.json" > "$work/logs/heldout_s$s.log" 2>&1 &
    pids+=($!)
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  grep -h "acc " "$work"/logs/heldout_s*.log || true
  echo "== heldout: $((SECONDS - t0)) s"
  [ $rc = 0 ] || { tail -n 5 "$work"/logs/heldout_s*.log; exit 1; }
fi
if want eval; then
  t0=$SECONDS
  pids=()
  for s in $SEEDS; do
    for side in talon sf; do
      d=$work/${side}_s$s; [ $side = talon ] && d=$d.sglang
      rm -rf "$work/eval/${side}_s$s"
      $T eval --model "$gguf" --draft "$d" --data "$work/dev/mt_bench.jsonl" "$work/dev/alpaca80.jsonl" \
        "$work/dev/humaneval.jsonl" --max-new-tokens "$MAX_NEW" --chain 3 --no-tree --temperatures 0 \
        --device cuda:0 --out "$work/eval/${side}_s$s" > "$work/logs/eval_${side}_s$s.log" 2>&1 &
      pids+=($!)
    done
  done
  rc=0
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  echo "== eval (6 side by side): $((SECONDS - t0)) s"
  [ $rc = 0 ] || { tail -n 5 "$work"/logs/eval_*.log; exit 1; }
fi
if want report; then
  python3 - "$work" "$SEEDS" <<'PY'
import json, os, statistics as st, sys
work, seeds = sys.argv[1], sys.argv[2].split()
R = {"seeds": seeds, "talon": {}, "specforge": {}}
for s in seeds:
    ev = [json.loads(l) for l in open(f"{work}/talon_s{s}/metrics.jsonl") if '"split":"eval"' in l]
    ho = json.load(open(f"{work}/heldout_s{s}.json"))
    for side, d, ed in (("talon", f"{work}/talon_s{s}.sglang", "talon"), ("specforge", f"{work}/sf_s{s}", "sf")):
        e = json.load(open(f"{work}/eval/{ed}_s{s}/eval.json"))
        tau = {r["category"]: r["tau"] for r in e["results"] if r["temperature"] == 0 and r["config"] == "chain-3"}
        geq = [r.get("greedy_equal") for r in e["results"] if r["category"] == "all"]
        R[side][s] = {"heldout_py": ho[d], "tau": tau, "greedy_equal": geq}
    R["talon"][s]["heldout_trainer"] = {"acc": ev[-1]["acc"], "cond_acc": ev[-1]["cond_acc"],
                                        "sim_accept_len": ev[-1]["sim_accept_len"], "samples": ev[-1]["samples"]}
cats = ["mt_bench", "alpaca80", "humaneval", "all"]
f3 = lambda v: f"{v:.3f}"
def agg(vals):
    vals = [v for v in vals if v == v]
    if not vals:
        return float("nan"), float("nan"), float("nan")
    return st.mean(vals), (st.stdev(vals) if len(vals) > 1 else 0.0), max(vals) - min(vals)
lines = ["| drafter | seed | held-back acc_0..6 | sim tau | " + " | ".join(f"tau {c}" for c in cats) + " |",
         "|---|---|---|---|" + "---|" * len(cats)]
rows = {}
for side, key in (("talon", "heldout_trainer"), ("talon", "heldout_py"), ("specforge", "heldout_py")):
    name = {"heldout_trainer": "Talon (trainer's eval)", "heldout_py": "Talon (same evaluator)"}[key] \
        if side == "talon" else "SpecForge 0.2.0"
    acc_rows, tau_rows, sim = [], [], []
    for s in seeds:
        h = R[side][s][key]
        tau = [R[side][s]["tau"].get(c, float("nan")) for c in cats]
        acc_rows.append(h["acc"]); tau_rows.append(tau); sim.append(h["sim_accept_len"])
        lines.append(f"| {name} | {s} | {' '.join(f3(a) for a in h['acc'])} | {f3(h['sim_accept_len'])} | "
                     + " | ".join(f"{t:.3f}" for t in tau) + " |")
    m_acc = [st.mean(c) for c in zip(*acc_rows)]
    a_tau = [agg(list(c)) for c in zip(*tau_rows)]
    a_sim = agg(sim)
    lines.append(f"| {name} | mean | {' '.join(f3(a) for a in m_acc)} | {f3(a_sim[0])} | "
                 + " | ".join(f"{m:.3f}" for m, _, _ in a_tau) + " |")
    lines.append(f"| {name} | sd / range | acc_0 sd {st.stdev([r[0] for r in acc_rows]) if len(seeds) > 1 else 0:.3f}"
                 f" range {max(r[0] for r in acc_rows) - min(r[0] for r in acc_rows):.3f} | "
                 f"{a_sim[1]:.3f} / {a_sim[2]:.3f} | " + " | ".join(f"{sd:.3f} / {rg:.3f}" for _, sd, rg in a_tau) + " |")
    rows[name] = {"acc_mean": m_acc, "tau": dict(zip(cats, a_tau)), "sim": a_sim}
t, r = rows["Talon (same evaluator)"], rows["SpecForge 0.2.0"]
verdict = []
for c in cats:
    tm, rm = t["tau"][c][0], r["tau"][c][0]
    spread = r["tau"][c][2]  # the reference's seed-to-seed range (max - min)
    verdict.append(f"{c}: Talon mean tau {tm:.3f} vs SpecForge {rm:.3f} - its seed range {spread:.3f} = "
                   f"{rm - spread:.3f} -> " + ("meets the bar" if tm >= rm - spread else "BELOW the bar")
                   + f" (Talon's own seed range {t['tau'][c][2]:.3f})")
R["table"] = lines
R["verdict"] = verdict
json.dump(R, open(f"{work}/results.json", "w"), indent=1)
open(f"{work}/summary.md", "w").write("\n".join(lines + [""] + verdict) + "\n")
print("\n".join(lines + [""] + verdict))
PY
  if [ -n "${OUT:-}" ]; then
    cp "$work/summary.md" "$work/results.json" "$OUT/"
    tar czf "$OUT/logs.tgz" -C "$work" $(cd "$work" && ls -d logs eval heldout_s*.json sf_s*.train.jsonl \
      sf_s*.done.json talon_s*/metrics.jsonl 2>/dev/null)
  fi
fi
