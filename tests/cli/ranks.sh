#!/usr/bin/env bash
# Several processes sharing one --out (one per node in real use): the dataset is
# byte-identical to a single-process run whichever way the ranks are given (flags,
# SLURM, OpenMPI, torchrun variables), in whatever order they start and finish; a
# killed rank's work is resumed by any later run; malformed rank settings are refused.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
tokens 24 49152 11 40 > "$WORK/data.jsonl"
args=(--model "$GGUF" --data "$WORK/data.jsonl" --shard-tokens 150 --max-batch-tokens 64 --threads 1)
export TALON_RUNS_DIR="$WORK/runs"
same_as_ref() { diff -r -x '.talon*.lock' "$WORK/ref" "$1" > "$WORK/diff" 2>&1; }

"$TALON" extract "${args[@]}" --out "$WORK/ref" > /dev/null 2>&1 && ok "single-process reference" || bad "reference failed"

# 1) Flags, both ranks at once.
"$TALON" extract "${args[@]}" --out "$WORK/two" --rank 1 --world 2 > "$WORK/r1.out" 2> "$WORK/r1.err" &
p1=$!
"$TALON" extract "${args[@]}" --out "$WORK/two" --rank 0 --world 2 > "$WORK/r0.out" 2> "$WORK/r0.err"
rc0=$?
wait $p1; rc1=$?
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && ok "ranks 0 and 1 exit 0" || bad "rc $rc0/$rc1: $(tail -2 "$WORK/r0.err") $(tail -2 "$WORK/r1.err")"
grep -q "rank 0 writes the manifest" "$WORK/r1.out" && ok "rank 1 leaves the manifest to rank 0" || bad "rank 1: $(cat "$WORK/r1.out")"
grep -q "extract complete" "$WORK/r0.out" && ok "rank 0 completes the dataset" || bad "rank 0: $(cat "$WORK/r0.out")"
grep -q "\[rank 1\]" "$WORK/r1.err" && ok "rank-prefixed log lines" || bad "no [rank 1] prefix: $(head -3 "$WORK/r1.err")"
same_as_ref "$WORK/two" && ok "2 ranks == 1 process (byte-identical, no progress files left)" || bad "differs: $(head -5 "$WORK/diff")"

# 2) Launcher variables; rank 1 alone first (it creates the manifest, writes its half and
# exits), then rank 0 (its half, then the merged manifest).
env SLURM_PROCID=1 SLURM_NTASKS=2 "$TALON" extract "${args[@]}" --out "$WORK/slurm" > /dev/null 2> "$WORK/s1.err"
grep -q "SLURM_PROCID/SLURM_NTASKS" "$WORK/s1.err" && ok "rank from SLURM variables" || bad "slurm: $(head -3 "$WORK/s1.err")"
ls "$WORK"/slurm/progress.rank-1.json > /dev/null 2>&1 && ok "rank 1 started first, recorded its shards and exited" || bad "no progress.rank-1.json"
env OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 "$TALON" extract "${args[@]}" --out "$WORK/slurm" > /dev/null 2> "$WORK/s0.err"
grep -q "OMPI_COMM_WORLD_RANK" "$WORK/s0.err" && ok "rank from OpenMPI variables" || bad "ompi: $(head -3 "$WORK/s0.err")"
same_as_ref "$WORK/slurm" && ok "rank 1 then rank 0 == 1 process" || bad "differs: $(head -5 "$WORK/diff")"

# 3) kill -9 rank 1 mid-run; a single process then finishes everything from the records.
env RANK=1 WORLD_SIZE=2 "$TALON" extract "${args[@]}" --out "$WORK/k9" > /dev/null 2>&1 &
pid=$!
"$TALON" extract "${args[@]}" --out "$WORK/k9" --rank 0 --world 2 > /dev/null 2>&1 &
p0=$!
wait_recorded "$WORK/k9/progress.rank-1.json" 1
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
kill -INT $p0; wait $p0; rc=$?
[ $rc -eq 130 ] && ok "rank 0 waiting for rank 1 stops on SIGINT (exit 130)" || ok "rank 0 ended with $rc before the signal"
"$TALON" extract "${args[@]}" --out "$WORK/k9" > "$WORK/k9.out" 2> "$WORK/k9.err"
[ $? -eq 0 ] && grep -q "resuming:" "$WORK/k9.err" && ok "single process resumes the 2-rank run" || bad "resume: $(tail -3 "$WORK/k9.err")"
same_as_ref "$WORK/k9" && ok "kill -9 of a rank + resume == 1 process" || bad "differs: $(head -5 "$WORK/diff")"
"$TALON" inspect "$WORK/k9" > "$WORK/inspect.out" 2>&1 && ok "inspect verifies it" || bad "inspect: $(tail -3 "$WORK/inspect.out")"

# 4) Refusals.
"$TALON" extract "${args[@]}" --out "$WORK/bad" --rank 2 --world 2 > /dev/null 2> "$WORK/b.err"
[ $? -ne 0 ] && grep -q -- "--rank/--world: rank 2 is outside a world of 2" "$WORK/b.err" && ok "rank >= world refused" || bad "$(cat "$WORK/b.err")"
env RANK=x WORLD_SIZE=2 "$TALON" extract "${args[@]}" --out "$WORK/bad" > /dev/null 2> "$WORK/b.err"
[ $? -ne 0 ] && grep -q "environment variable RANK='x' is not a non-negative integer" "$WORK/b.err" && ok "malformed RANK refused" || bad "$(cat "$WORK/b.err")"
"$TALON" extract "${args[@]}" --out "$WORK/bad" --rank 1 > /dev/null 2> "$WORK/b.err"
[ $? -ne 0 ] && grep -q -- "--rank and --world go together" "$WORK/b.err" && ok "--rank without --world refused" || bad "$(cat "$WORK/b.err")"
finish
