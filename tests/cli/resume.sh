#!/usr/bin/env bash
# Resumability: kill -9 in the middle of an extraction, rerun the same command, and the
# dataset must be identical (every byte of every shard and the manifest) to an
# uninterrupted run; SIGINT must stop cleanly with a resume hint; a finished run is
# not redone; a different job in the same --out is refused.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
tokens 24 49152 7 40 > "$WORK/data.jsonl"
args=(--model "$GGUF" --data "$WORK/data.jsonl" --shard-tokens 150 --max-batch-tokens 128 --threads 2)

"$TALON" extract "${args[@]}" --out "$WORK/ref" > /dev/null 2>&1 && ok "uninterrupted run" || bad "uninterrupted run failed"
nref=$(ls "$WORK"/ref/shard-*.safetensors | wc -l)
[ "$nref" -ge 5 ] && ok "reference has $nref shards" || bad "reference has only $nref shards"

same_as_ref() {  # every file but the lock, byte for byte
  diff -r -x .talon.lock "$WORK/ref" "$1" > "$WORK/diff" 2>&1
}

# 1) kill -9 after at least two shards are recorded, then resume.
"$TALON" extract "${args[@]}" --out "$WORK/k9" > /dev/null 2>&1 &
pid=$!
wait_recorded "$WORK/k9/manifest.json" 2
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
n=$(grep -c '"sha256"' "$WORK/k9/manifest.json")
if [ "$n" -lt "$nref" ] && grep -q '"in_progress"' "$WORK/k9/manifest.json"; then ok "killed mid-run with $n/$nref shards recorded"; else bad "kill -9 did not land mid-run ($n/$nref)"; fi
"$TALON" extract "${args[@]}" --out "$WORK/k9" > "$WORK/resume.out" 2> "$WORK/resume.err"
rc=$?
[ $rc -eq 0 ] && ok "resume exit 0" || bad "resume exit $rc: $(tail -2 "$WORK/resume.err")"
grep -q "resuming: $n of" "$WORK/resume.err" && ok "resume says it continued from shard $n" || bad "resume did not report continuing: $(cat "$WORK/resume.err")"
same_as_ref "$WORK/k9" && ok "kill -9 + resume == uninterrupted (byte-identical)" || bad "resumed dataset differs: $(head -5 "$WORK/diff")"
ls "$WORK"/k9 | grep -q 'tmp-' && bad "temp files left behind" || ok "no temp files left"
"$TALON" inspect "$WORK/k9" > "$WORK/inspect.out" 2>&1 && ok "inspect verifies the resumed dataset" || bad "inspect failed: $(tail -3 "$WORK/inspect.out")"

# 2) A deterministic interruption at a shard boundary (the test hook), then resume.
"$TALON" extract "${args[@]}" --out "$WORK/hook" --stop-after-shards 3 > /dev/null 2> "$WORK/hook.err"
rc=$?
[ $rc -ne 0 ] && grep -q "resume with: .*extract" "$WORK/hook.err" && ok "interrupted run exits $rc with a resume hint" || bad "interrupted run: rc $rc, $(tail -2 "$WORK/hook.err")"
"$TALON" extract "${args[@]}" --out "$WORK/hook" > /dev/null 2>&1
same_as_ref "$WORK/hook" && ok "stop at shard 3 + resume == uninterrupted" || bad "differs after hook stop: $(head -3 "$WORK/diff")"

# 3) SIGINT: stops within seconds, exits non-zero, prints the resume command, resumes identically.
"$TALON" extract "${args[@]}" --out "$WORK/int" > /dev/null 2> "$WORK/int.err" &
pid=$!
wait_recorded "$WORK/int/manifest.json" 1
kill -INT $pid
t0=$(date +%s)
wait $pid; rc=$?
dt=$(( $(date +%s) - t0 ))
if [ $rc -eq 130 ] && [ $dt -le 10 ] && grep -q "resume with:" "$WORK/int.err"; then ok "SIGINT: exit 130 after ${dt}s with resume hint"
elif [ $rc -eq 0 ]; then ok "SIGINT arrived after the last shard (run finished)"
else bad "SIGINT: rc $rc after ${dt}s: $(tail -2 "$WORK/int.err")"; fi
"$TALON" extract "${args[@]}" --out "$WORK/int" > /dev/null 2>&1
same_as_ref "$WORK/int" && ok "SIGINT + resume == uninterrupted" || bad "differs after SIGINT: $(head -3 "$WORK/diff")"

# 4) Rerunning a finished job does nothing; a different job is refused.
"$TALON" extract "${args[@]}" --out "$WORK/ref" > "$WORK/again.out" 2>&1
grep -q "already complete" "$WORK/again.out" && ok "finished run is not redone" || bad "finished run redone"
"$TALON" extract "${args[@]}" --out "$WORK/ref" --layers 3,10,20 > /dev/null 2> "$WORK/diff.err"
[ $? -ne 0 ] && grep -q "holds a different extraction.*aux_layer_ids" "$WORK/diff.err" && ok "different --layers refused" || bad "different job not refused: $(cat "$WORK/diff.err")"
same_as_ref "$WORK/ref" && ok "refused run left the dataset untouched" || bad "refused run changed the dataset"

# 5) A corrupted shard is caught by inspect.
cp -r "$WORK/ref" "$WORK/corrupt"
f=$(ls "$WORK"/corrupt/shard-*.safetensors | head -2 | tail -1)
printf '\x01' | dd of="$f" bs=1 seek=$(( $(stat -c %s "$f") - 10 )) conv=notrunc 2>/dev/null
"$TALON" inspect "$WORK/corrupt" > "$WORK/c.out" 2>&1
[ $? -ne 0 ] && grep -q "SHA-256 .* does not match" "$WORK/c.out" && ok "inspect catches a flipped byte" || bad "inspect missed corruption: $(tail -3 "$WORK/c.out")"
# 6) Run lifecycle: the lock records the run; a second run on the same --out is refused;
# `talon gpus` lists the run; `talon stop DIR` signals exactly the recorded PID, which
# drains and exits with a resume hint; the rerun completes identically.
export TALON_RUNS_DIR="$WORK/runs"
"$TALON" extract "${args[@]}" --out "$WORK/stop" > /dev/null 2> "$WORK/stop.err" &
pid=$!
wait_recorded "$WORK/stop/manifest.json" 1
python3 - "$WORK/stop/.talon.lock" "$pid" <<'PY' && ok "lock file records pid, host, command" || bad "lock file: $(cat "$WORK/stop/.talon.lock")"
import json, socket, sys
j = json.load(open(sys.argv[1]))
assert j["pid"] == int(sys.argv[2]) and j["command"] == "extract" and j["host"] == socket.gethostname(), j
assert "extract" in j["cmdline"] and j["gpus"] == [], j
PY
"$TALON" extract "${args[@]}" --out "$WORK/stop" > /dev/null 2> "$WORK/second.err"
[ $? -ne 0 ] && grep -q "another talon run (pid $pid on .*) is writing this directory; stop it with .talon stop" "$WORK/second.err" \
  && ok "a second run on the same --out is refused, naming pid $pid" || bad "second run: $(cat "$WORK/second.err")"
"$TALON" gpus > "$WORK/gpus.out" 2>&1
grep -q "talon extract (pid $pid, $WORK/stop)" "$WORK/gpus.out" && ok "talon gpus lists the active run" || bad "talon gpus: $(cat "$WORK/gpus.out")"
stop_checked "$WORK/stop" $pid "$WORK/stop.err" extract 20
"$TALON" gpus > "$WORK/gpus2.out" 2>&1
grep -q "0 active" "$WORK/gpus2.out" && ok "the run left the registry" || bad "registry still lists it: $(cat "$WORK/gpus2.out")"
"$TALON" stop "$WORK/stop" > "$WORK/stop2.out" 2>&1
grep -q "no run is active" "$WORK/stop2.out" && ok "talon stop on an idle directory signals nothing" || bad "$(cat "$WORK/stop2.out")"
"$TALON" extract "${args[@]}" --out "$WORK/stop" > /dev/null 2>&1
same_as_ref "$WORK/stop" && ok "talon stop + resume == uninterrupted" || bad "differs after talon stop: $(head -3 "$WORK/diff")"
finish
