#!/usr/bin/env bash
# talon train across processes (CPU, MPI): mpirun -np 2 logs the same losses,
# gradient norms and evaluations, bit for bit, as one process (EAGLE-3, P-EAGLE and DFlash); a run stopped at one world
# size and resumed at another continues with the same bits; rank variables without an MPI
# launcher are refused on the CPU; ranks that disagree on the job end the whole job
# (no hang). Skips (77) where Open MPI's mpirun is not installed.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
command -v mpirun > /dev/null || { echo "skip: no mpirun (Debian: openmpi-bin)"; exit 77; }
# Containers: no ptrace-based single copy between ranks; root is allowed to run it here.
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export TALON_RUNS_DIR="$WORK/runs"
mpi() { local n=$1; shift; timeout 300 mpirun -np "$n" --bind-to none "$@"; }

# 12 short samples (loss mask on their second half): 3 held back, 9 to train on in steps of
# 4, 4 and 1 samples (a one-sample step too), two epochs.
tokens 12 49152 5 24 > "$WORK/tok.jsonl"
"$TALON" extract --model "$GGUF" --data "$WORK/tok.jsonl" --out "$WORK/feat" > /dev/null 2>&1 || { bad "extract"; finish; }
base=(--data "$WORK/feat" --model "$GGUF" --draft-vocab 256 --ttt-steps 2 --epochs 2 --save-every 2 --lr 1e-3
      --warmup-steps 1 --batch-samples 4 --eval-fraction 0.25 --eval-every 3 --threads 1 --seed 3)
# Every logged number but the speed, one record a line.
record() {
  python3 - "$1" <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    r.pop("tokens_per_s", None)
    print(json.dumps(r, sort_keys=True))
PY
}

"$TALON" train "${base[@]}" --out "$WORK/one" > /dev/null 2> "$WORK/one.err" && ok "one process" \
  || bad "one process: $(tail -3 "$WORK/one.err")"
ref=$(record "$WORK/one/metrics.jsonl")
[ "$(grep -c '"split":"eval"' "$WORK/one/metrics.jsonl")" -eq 2 ] && [ "$(grep -c '"grad_norm"' "$WORK/one/metrics.jsonl")" -eq 6 ] \
  && ok "6 steps + 2 evaluations logged" \
  || bad "metrics: $(cat "$WORK/one/metrics.jsonl")"

for n in 2; do
  mpi $n "$TALON" train "${base[@]}" --out "$WORK/np$n" > "$WORK/np$n.out" 2> "$WORK/np$n.err"
  rc=$?
  if [ $rc -eq 0 ] && [ "$(record "$WORK/np$n/metrics.jsonl")" = "$ref" ]; then
    ok "mpirun -np $n: the same losses, gradient norms and evaluations as one process, bit for bit"
  else
    bad "mpirun -np $n (rc $rc): $(tail -3 "$WORK/np$n.err") | $(diff <(echo "$ref") <(record "$WORK/np$n/metrics.jsonl") | head -4)"
  fi
done
grep -q "\[rank 1\].*rank 1 of 2 (OMPI_COMM_WORLD_RANK/OMPI_COMM_WORLD_SIZE; collectives over MPI)" "$WORK/np2.err" \
  && ok "every rank logs, prefixed with its rank" || bad "rank log lines: $(grep -m3 rank "$WORK/np2.err")"
cmp -s "$WORK/one/checkpoint.safetensors" "$WORK/np2/checkpoint.safetensors" \
  && ok "the 2-process checkpoint is byte-identical to the one-process checkpoint" || bad "checkpoints differ"

# Stopped at one world size, resumed at another.
mpi 2 "$TALON" train "${base[@]}" --out "$WORK/r23" --stop-after-steps 3 > /dev/null 2> "$WORK/r23a.err"
rc=$?
[ $rc -ne 0 ] && grep -q "resume with: .*train" "$WORK/r23a.err" && ok "2 processes stop at step 3 with a resume hint" \
  || bad "stop: rc $rc $(tail -3 "$WORK/r23a.err")"
mpi 3 "$TALON" train "${base[@]}" --out "$WORK/r23" > /dev/null 2> "$WORK/r23b.err"
grep -q "resuming from .* at step 3 of 6" "$WORK/r23b.err" && ok "3 processes resume at step 3" \
  || bad "resume: $(grep -m2 -i resum "$WORK/r23b.err")"
[ "$(record "$WORK/r23/metrics.jsonl")" = "$ref" ] && ok "stopped with 2 processes, resumed with 3: identical bits" \
  || bad "2 -> 3: $(diff <(echo "$ref") <(record "$WORK/r23/metrics.jsonl") | head -4)"
"$TALON" train "${base[@]}" --out "$WORK/r12" --stop-after-steps 2 > /dev/null 2>&1
mpi 2 "$TALON" train "${base[@]}" --out "$WORK/r12" > /dev/null 2> "$WORK/r12.err"
[ "$(record "$WORK/r12/metrics.jsonl")" = "$ref" ] && ok "stopped as one process, resumed with 2: identical bits" \
  || bad "1 -> 2: $(tail -2 "$WORK/r12.err") $(diff <(echo "$ref") <(record "$WORK/r12/metrics.jsonl") | head -4)"

# The other drafter families: one process and two give the same bits (their gradients are
# summed in the same tree), and a run stopped with two processes resumes as one.
fam_peagle=(--drafter peagle)
fam_dflash=(--drafter dflash --draft-layers 2 --block-size 4 --max-anchors 8)
for fam in peagle dflash; do
  declare -n extra="fam_$fam"
  fargs=("${extra[@]}" "${base[@]}")
  "$TALON" train "${fargs[@]}" --out "$WORK/${fam}1" > /dev/null 2> "$WORK/${fam}1.err" \
    || bad "$fam, one process: $(tail -3 "$WORK/${fam}1.err")"
  fref=$(record "$WORK/${fam}1/metrics.jsonl")
  mpi 2 "$TALON" train "${fargs[@]}" --out "$WORK/${fam}2" > /dev/null 2> "$WORK/${fam}2.err"
  rc=$?
  if [ $rc -eq 0 ] && [ -n "$fref" ] && [ "$(record "$WORK/${fam}2/metrics.jsonl")" = "$fref" ] \
     && cmp -s "$WORK/${fam}1/checkpoint.safetensors" "$WORK/${fam}2/checkpoint.safetensors"; then
    ok "$fam: mpirun -np 2 logs the same numbers and writes the same checkpoint as one process"
  else
    bad "$fam, 2 processes (rc $rc): $(tail -3 "$WORK/${fam}2.err") | $(diff <(echo "$fref") <(record "$WORK/${fam}2/metrics.jsonl") | head -4)"
  fi
  mpi 2 "$TALON" train "${fargs[@]}" --out "$WORK/${fam}r" --stop-after-steps 3 > /dev/null 2>&1
  "$TALON" train "${fargs[@]}" --out "$WORK/${fam}r" > /dev/null 2> "$WORK/${fam}r.err"
  [ "$(record "$WORK/${fam}r/metrics.jsonl")" = "$fref" ] && ok "$fam: stopped with 2 processes, resumed as one: identical bits" \
    || bad "$fam 2 -> 1: $(tail -2 "$WORK/${fam}r.err") $(diff <(echo "$fref") <(record "$WORK/${fam}r/metrics.jsonl") | head -4)"
done

# Refusals.
RANK=0 WORLD_SIZE=2 "$TALON" train "${base[@]}" --out "$WORK/x1" > /dev/null 2> "$WORK/e1"
[ $? -ne 0 ] && grep -q "training on CPUs across processes needs MPI" "$WORK/e1" && ok "CPU ranks without MPI refused" \
  || bad "$(cat "$WORK/e1")"
# Rank 1 is given another seed: the job check fails on every rank and the job ends.
noseed=("${base[@]:0:${#base[@]}-2}")  # (--seed 3 comes last)
mpi 2 bash -c 's=3; [ "$OMPI_COMM_WORLD_RANK" = 1 ] && s=4; exec "$0" train "$@" --seed $s' \
  "$TALON" "${noseed[@]}" --out "$WORK/x3" > /dev/null 2> "$WORK/e3"
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "rank 1 and rank 0 disagree" "$WORK/e3" \
  && ok "ranks that disagree on the job: refused, and the whole job ends (rc $rc)" || bad "rc $rc: $(tail -4 "$WORK/e3")"
finish
