#!/usr/bin/env bash
# Fault injection for prepare, extract and train (generate does not exist yet):
#   1. kill -9 at seeded random moments (FAULT_SEEDS per stage, default 4; up to two kills
#      per seed), then rerun: the outputs must be byte-identical to an uninterrupted run;
#   2. a full disk (an LD_PRELOAD shim fails writes under the output directory with ENOSPC
#      after a seeded byte budget): a clear error naming the file and "No space left",
#      nothing truncated accepted, and a rerun with space completes identically; where
#      mounting is allowed, the same on a real (small) tmpfs;
#   3. a flipped byte in a shard, a checkpoint and a tokens file: caught by checksum on
#      read, the error names the file;
#   4. SIGTERM / SIGINT: the run stops within seconds with a resume hint, and resumes.
# FAULT_SEEDS=50 gives a longer sweep. Prints "faults: ..." figures at the end.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
SHIM=${TALON_ENOSPC_SHIM:-$(dirname "$TALON")/tests/libtalon_enospc.so}
SEEDS=${FAULT_SEEDS:-4}
BASE=${FAULT_SEED_BASE:-1}
KILLS=0 SURVIVED=0 FAULTS=0
# An ASan build wants its runtime first in the library list; the shim comes before it.
export ASAN_OPTIONS=${ASAN_OPTIONS:+$ASAN_OPTIONS:}verify_asan_link_order=0

# Inputs, small enough for many runs on two CPU cores: 2000 chats (the demo chats,
# renamed) for prepare; 8 short token samples for extract (4 shards); 8 steps of train.
python3 - "$SRC/examples/demo_chats.jsonl" > "$WORK/chats.jsonl" <<'PY'
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
for k in range(250):
    for i, r in enumerate(recs):
        r = dict(r); r["id"] = f"c{k}-{i}"
        print(json.dumps(r))
PY
PREP=(prepare --model "$GGUF" --data "$WORK/chats.jsonl" --threads 2)
tokens 8 49152 7 12 > "$WORK/tokens.jsonl"
EXTR0=(extract --model "$GGUF" --shard-tokens 30 --max-batch-tokens 32 --threads 2)
TRAIN0=(train --model "$GGUF" --draft-vocab 128 --max-length 16 --ttt-steps 2 --max-steps 8 --save-every 2 --lr 1e-3
        --warmup-steps 2 --batch-samples 1 --seed 3 --threads 2)

ms() { date +%s%3N; }
t0=$(ms); "$TALON" "${PREP[@]}" --out "$WORK/ref_tok" > /dev/null 2> "$WORK/e" || { bad "reference prepare: $(tail -2 "$WORK/e")"; finish; }
T_PREP=$(( $(ms) - t0 ))
EXTR=("${EXTR0[@]}" --data "$WORK/tokens.jsonl")
t0=$(ms); "$TALON" "${EXTR[@]}" --out "$WORK/ref_feat" > /dev/null 2> "$WORK/e" || { bad "reference extract: $(tail -2 "$WORK/e")"; finish; }
T_EXTR=$(( $(ms) - t0 ))
TRAIN=("${TRAIN0[@]}" --data "$WORK/ref_feat")
t0=$(ms); "$TALON" "${TRAIN[@]}" --out "$WORK/ref_run" > /dev/null 2> "$WORK/e" || { bad "reference train: $(tail -2 "$WORK/e")"; finish; }
T_TRAIN=$(( $(ms) - t0 ))
nshards=$(ls "$WORK"/ref_feat/shard-*.safetensors | wc -l)
ok "reference runs: prepare ${T_PREP} ms, extract ${T_EXTR} ms ($nshards shards), train ${T_TRAIN} ms"

REF_LOSSES=$(losses "$WORK/ref_run/metrics.jsonl")
# same_STAGE DIR: the stage's outputs in DIR equal the reference's, byte for byte.
same_prepare() { cmp -s "$WORK/ref_tok/tokens.jsonl" "$1/tokens.jsonl" && cmp -s "$WORK/ref_tok/manifest.json" "$1/manifest.json"; }
same_extract() { diff -r -x .talon.lock "$WORK/ref_feat" "$1" > /dev/null 2>&1; }
same_train() {
  cmp -s "$WORK/ref_run/checkpoint.safetensors" "$1/checkpoint.safetensors" &&
    [ "$(losses "$1/metrics.jsonl")" = "$REF_LOSSES" ]
}
no_temps() { ! ls -a "$1" 2>/dev/null | grep -q 'tmp-'; }

# ---------------------------------------------------------------- 1. kill -9 sweep
# Each seed: up to two runs killed at random moments within the reference duration (plus
# start-up), then one run to completion.
sweep() {
  local stage=$1 tref=$2; shift 2
  local s out pid k delay kills_here survived_here=0 tried_here=0
  for s in $(seq "$BASE" $((BASE + SEEDS - 1))); do
    RANDOM=$((s * 7919 + ${#stage}))
    out="$WORK/k_${stage}_$s"
    kills_here=0
    for k in 1 2; do
      delay=$(( RANDOM % tref ))
      "$TALON" "$@" --out "$out" > /dev/null 2> "$WORK/k.err" &
      pid=$!
      sleep "$((delay / 1000)).$(printf '%03d' $((delay % 1000)))"
      if kill -9 "$pid" 2>/dev/null; then
        wait "$pid" 2>/dev/null
        kills_here=$((kills_here + 1))
      else
        wait "$pid" 2>/dev/null
        break  # finished before the kill
      fi
    done
    "$TALON" "$@" --out "$out" > /dev/null 2> "$WORK/k.err"
    local rc=$?
    KILLS=$((KILLS + kills_here)); tried_here=$((tried_here + kills_here))
    if [ $rc -eq 0 ] && "same_$stage" "$out" && no_temps "$out"; then
      SURVIVED=$((SURVIVED + kills_here)); survived_here=$((survived_here + kills_here))
    else
      bad "$stage seed $s: after $kills_here kill(s) the rerun gave rc $rc or different outputs: $(tail -2 "$WORK/k.err")"
    fi
    rm -rf "$out"
  done
  [ "$survived_here" -eq "$tried_here" ] && ok "$stage: $tried_here kill -9 points over $SEEDS seeds, all reruns identical to the uninterrupted run"
}
sweep prepare "$T_PREP" "${PREP[@]}"
sweep extract "$T_EXTR" "${EXTR[@]}"
sweep train "$T_TRAIN" "${TRAIN[@]}"

# ---------------------------------------------------------------- 2. disk full
tok_bytes=$(stat -c %s "$WORK/ref_tok/tokens.jsonl")
shard_bytes=$(stat -c %s "$WORK/ref_feat/shard-00000.safetensors")
ckpt_bytes=$(stat -c %s "$WORK/ref_run/checkpoint.safetensors")
if [ -f "$SHIM" ]; then
  # enospc STAGE BYTES FILE_PATTERN: the run fails naming the file with "No space left",
  # leaves no temporaries and no unverifiable output; a rerun without the fault completes
  # identically.
  enospc() {
    local stage=$1 budget=$2 pattern=$3; shift 3
    local out="$WORK/nospc_${stage}_$budget"
    mkdir -p "$out"
    [ "$stage" = prepare ] && rmdir "$out"
    FAULTS=$((FAULTS + 1))
    TALON_FAULT_DIR="$out" TALON_FAULT_ENOSPC_AFTER=$budget LD_PRELOAD="$SHIM" \
      "$TALON" "$@" --out "$out" > /dev/null 2> "$WORK/nospc.err"
    local rc=$?
    if [ $rc -eq 0 ]; then
      bad "$stage with $budget bytes of space: succeeded (the budget was not reached?)"
      return
    fi
    if grep -q "No space left on device" "$WORK/nospc.err" && grep -qE "$pattern" "$WORK/nospc.err"; then
      ok "$stage, disk full after $budget bytes: rc $rc, error names the file: $(grep -m1 -o "error: .*" "$WORK/nospc.err" | cut -c1-150)"
    else
      bad "$stage, disk full after $budget bytes: unclear error (rc $rc): $(tail -3 "$WORK/nospc.err")"
    fi
    no_temps "$out" && ok "$stage: no temporary files left" || bad "$stage: temporaries left: $(ls "$out")"
    case $stage in
      prepare) [ ! -e "$out/manifest.json" ] && ok "prepare: no manifest written" || bad "prepare wrote a manifest";;
      extract) "$TALON" inspect "$out" > "$WORK/insp" 2>&1 && ok "extract: the partial dataset verifies (only whole shards listed)" \
                 || bad "extract: partial dataset does not verify: $(tail -3 "$WORK/insp")";;
      train) if [ -f "$out/checkpoint.safetensors" ]; then
               python3 - "$out/checkpoint.safetensors" <<'PY' && ok "train: the kept checkpoint is whole" || bad "train: checkpoint damaged"
import json, struct, sys, os
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
end = max(v["data_offsets"][1] for k, v in h.items() if k != "__metadata__")
assert len(b) == 8 + n + end, (len(b), n, end)
PY
             fi;;
    esac
    "$TALON" "$@" --out "$out" > /dev/null 2> "$WORK/nospc2.err"
    rc=$?
    [ $rc -eq 0 ] && "same_$stage" "$out" && ok "$stage: rerun with space completes, identical to the uninterrupted run" \
      || bad "$stage: rerun after freeing space: rc $rc, $(tail -2 "$WORK/nospc2.err")"
    rm -rf "$out"
  }
  RANDOM=$BASE
  enospc prepare $(( RANDOM % tok_bytes )) "tokens.jsonl" "${PREP[@]}"
  enospc extract $(( RANDOM % shard_bytes )) "shard-[0-9]+\.safetensors" "${EXTR[@]}"
  enospc extract $(( 2 * shard_bytes + RANDOM % shard_bytes )) "shard-[0-9]+\.safetensors" "${EXTR[@]}"
  enospc train $(( RANDOM % ckpt_bytes )) "checkpoint.safetensors|metrics.jsonl" "${TRAIN[@]}"
  enospc train $(( 2 * ckpt_bytes + RANDOM % ckpt_bytes )) "checkpoint.safetensors|metrics.jsonl" "${TRAIN[@]}"
else
  bad "no ENOSPC shim at $SHIM (build the talon_enospc target)"
fi

# A real full file system where mounting is allowed (root, not forbidden by the container):
# a small tmpfs. Extract fills it with shards; train's second checkpoint needs room for the
# new file beside the old one. After the mount is made larger, the rerun completes.
MNT="$WORK/mnt"
mkdir -p "$MNT"
if [ "$(id -u)" -eq 0 ] && mount -t tmpfs -o size=$(( shard_bytes * 5 / 2 )) tmpfs "$MNT" 2>/dev/null; then
  trap 'umount "$MNT" 2>/dev/null; keep_reports; rm -rf "$WORK"' EXIT
  for stage in extract train; do
    if [ $stage = extract ]; then cmd=("${EXTR[@]}"); size=$(( shard_bytes * 5 / 2 )); else cmd=("${TRAIN[@]}"); size=$(( ckpt_bytes * 3 / 2 )); fi
    mount -o remount,size=$size "$MNT"
    rm -rf "${MNT:?}"/*
    FAULTS=$((FAULTS + 1))
    "$TALON" "${cmd[@]}" --out "$MNT/out" > /dev/null 2> "$WORK/tmpfs.err"
    rc=$?
    [ $rc -ne 0 ] && grep -q "No space left on device" "$WORK/tmpfs.err" \
      && ok "$stage on a full tmpfs ($size bytes): rc $rc, $(grep -m1 -o 'error: [^:]*' "$WORK/tmpfs.err")" \
      || bad "$stage on a full tmpfs: rc $rc, $(tail -2 "$WORK/tmpfs.err")"
    no_temps "$MNT/out" && ok "$stage: no temporaries left on the full tmpfs" || bad "$stage: temporaries left: $(ls -a "$MNT/out")"
    mount -o remount,size=$(( size * 4 )) "$MNT"
    "$TALON" "${cmd[@]}" --out "$MNT/out" > /dev/null 2> "$WORK/tmpfs.err"
    [ $? -eq 0 ] && "same_$stage" "$MNT/out" && ok "$stage: rerun after the tmpfs grew completes, identical" \
      || bad "$stage: rerun on the grown tmpfs: $(tail -2 "$WORK/tmpfs.err")"
  done
  umount "$MNT"
else
  echo "skip - tmpfs disk-full test: mounting is not permitted here (the ENOSPC shim covers it)"
fi

# ---------------------------------------------------------------- 3. flipped bytes
flip() {  # flip FILE OFFSET: inverts one byte
  python3 - "$1" "$2" <<'PY'
import sys
p, off = sys.argv[1], int(sys.argv[2])
with open(p, "r+b") as f:
    f.seek(off); b = f.read(1); f.seek(off); f.write(bytes([b[0] ^ 0xFF]))
PY
}
# A shard of an unfinished extraction (stopped after its first work unit; small batches
# make several units): the resume refuses it by checksum.
"$TALON" extract --model "$GGUF" --shard-tokens 30 --max-batch-tokens 8 --threads 2 --data "$WORK/tokens.jsonl" \
  --out "$WORK/fl_ext" --stop-after-shards 1 > /dev/null 2>&1
f="$WORK/fl_ext/shard-00000.safetensors"
grep -q '"in_progress"' "$WORK/fl_ext/manifest.json" && [ -f "$f" ] || bad "could not make an unfinished extraction"
flip "$f" $(( $(stat -c %s "$f") / 2 )); FAULTS=$((FAULTS + 1))
"$TALON" "${EXTR[@]}" --out "$WORK/fl_ext" > /dev/null 2> "$WORK/fl.err"
[ $? -ne 0 ] && grep -q "shard-00000.safetensors: SHA-256 .* does not match" "$WORK/fl.err" \
  && ok "extract resume: flipped byte in a kept shard detected, named" \
  || bad "extract resume accepted a corrupt shard: $(tail -2 "$WORK/fl.err")"
# A shard of a finished dataset: train refuses it.
cp -r "$WORK/ref_feat" "$WORK/fl_feat"
f="$WORK/fl_feat/shard-00002.safetensors"
flip "$f" $(( $(stat -c %s "$f") - 5 )); FAULTS=$((FAULTS + 1))
"$TALON" "${TRAIN0[@]}" --data "$WORK/fl_feat" --out "$WORK/fl_run1" > /dev/null 2> "$WORK/fl.err"
[ $? -ne 0 ] && grep -q "shard-00002.safetensors: SHA-256 .* does not match" "$WORK/fl.err" \
  && ok "train: flipped byte in a shard detected, named" || bad "train accepted a corrupt shard: $(tail -2 "$WORK/fl.err")"
# The checkpoint: a byte of the tensor data, and one of the metadata.
for where in data meta; do
  cp -r "$WORK/ref_run" "$WORK/fl_run_$where"
  f="$WORK/fl_run_$where/checkpoint.safetensors"
  if [ $where = data ]; then flip "$f" $(( $(stat -c %s "$f") - 100 )); else
    # the step count in the metadata, changed to another digit: the header stays valid JSON
    python3 - "$f" <<'PY'
import sys
p = sys.argv[1]
b = bytearray(open(p, "rb").read())
i = b.find(b'\\"step\\":') + len(b'\\"step\\":')
assert i > 20 and chr(b[i]).isdigit(), b[i - 20:i + 5]
b[i] = ord("7") if b[i] != ord("7") else ord("3")
open(p, "wb").write(b)
PY
  fi
  FAULTS=$((FAULTS + 1))
  "$TALON" "${TRAIN[@]}" --out "$WORK/fl_run_$where" > /dev/null 2> "$WORK/fl.err"
  [ $? -ne 0 ] && grep -q "checkpoint.safetensors: checksum mismatch" "$WORK/fl.err" \
    && ok "train resume: flipped $where byte in the checkpoint detected, named" \
    || bad "train resumed from a corrupt checkpoint ($where): $(tail -2 "$WORK/fl.err")"
done
# tokens.jsonl of a prepared directory.
cp -r "$WORK/ref_tok" "$WORK/fl_tok"
flip "$WORK/fl_tok/tokens.jsonl" 30; FAULTS=$((FAULTS + 1))
"$TALON" "${EXTR0[@]}" --data "$WORK/fl_tok" --out "$WORK/fl_feat2" > /dev/null 2> "$WORK/fl.err"
[ $? -ne 0 ] && grep -q "fl_tok/tokens.jsonl" "$WORK/fl.err" && ok "extract: flipped byte in tokens.jsonl detected, named" \
  || bad "extract accepted a corrupt tokens.jsonl: $(tail -2 "$WORK/fl.err")"

# ---------------------------------------------------------------- 4. SIGTERM / SIGINT
# stop_test STAGE SIGNAL CODE WAIT_FOR: signal once WAIT_FOR exists (or after a pause), the
# run must exit with CODE within 10 s printing "resume with:", and the rerun complete identically.
stop_test() {
  local stage=$1 sig=$2 code=$3 marker=$4; shift 4
  local out="$WORK/sig_${stage}_$sig" i
  "$TALON" "$@" --out "$out" > /dev/null 2> "$WORK/sig.err" &
  local pid=$!
  for i in $(seq 1 400); do [ -e "$out/$marker" ] && break; sleep 0.02; done
  local t0=$(ms)
  kill -"$sig" "$pid"; FAULTS=$((FAULTS + 1))
  wait "$pid"; local rc=$?
  local dt=$(( $(ms) - t0 ))
  if [ $rc -eq "$code" ] && [ $dt -le 10000 ] && grep -q "resume with: .*$stage" "$WORK/sig.err"; then
    ok "$stage: SIG$sig -> exit $rc after $dt ms with a resume hint"
  elif [ $rc -eq 0 ]; then
    ok "$stage: SIG$sig arrived after the work was done (exit 0)"
  else
    bad "$stage: SIG$sig: rc $rc after $dt ms: $(tail -2 "$WORK/sig.err")"
  fi
  "$TALON" "$@" --out "$out" > /dev/null 2> "$WORK/sig2.err"
  [ $? -eq 0 ] && "same_$stage" "$out" && ok "$stage: resumed after SIG$sig, identical" || bad "$stage: resume after SIG$sig: $(tail -2 "$WORK/sig2.err")"
}
stop_test prepare TERM 143 "" "${PREP[@]}"
stop_test extract TERM 143 manifest.json "${EXTR[@]}"
stop_test extract INT 130 manifest.json "${EXTR[@]}"
stop_test train TERM 143 metrics.jsonl "${TRAIN[@]}"
stop_test train INT 130 checkpoint.safetensors "${TRAIN[@]}"

echo "faults: kill -9 points tried $KILLS, survived $SURVIVED; other faults injected $FAULTS; seeds $BASE..$((BASE + SEEDS - 1)) per stage"
[ "$KILLS" -gt 0 ] && [ "$KILLS" -eq "$SURVIVED" ] && ok "every kill -9 was survived ($SURVIVED)" || bad "kills survived: $SURVIVED of $KILLS"
finish
