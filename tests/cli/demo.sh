#!/usr/bin/env bash
# The README's first command, scripts/demo.sh, end to end with the built binary (its setup and
# build steps skipped): it must finish, print no warning or error on a clean run, end with the
# eval table and the guide to reading it, and leave every output it names. Full tier only
# (TALON_TEST_FULL=1): about two minutes of CPU.
source "$(dirname "$0")/lib.sh"
[ "${TALON_TEST_FULL:-0}" = 1 ] || { echo "skipped: full tier only (TALON_TEST_FULL=1)"; exit 77; }
# Under the sanitizers the CPU demo runs past the scenario time limit; the stages it chains are
# each covered there by their own scenarios.
[ -z "${TALON_SANITIZER_REPORTS:-}" ] || { echo "skipped under the sanitizers"; exit 77; }
TALON_DEMO_BIN=$TALON bash "$SRC/scripts/demo.sh" "$WORK/demo" > "$WORK/out" 2>&1
rc=$?
[ $rc -eq 0 ] && ok "demo finished" || bad "demo exit $rc: $(tail -5 "$WORK/out")"
# Progress bars redraw with carriage returns; judge the final text of each line.
tr '\r' '\n' < "$WORK/out" > "$WORK/lines"
if grep -inE "warn|error|traceback|no matching distribution" "$WORK/lines" > "$WORK/bad"; then
  bad "demo output has warnings or errors: $(head -5 "$WORK/bad")"
else
  ok "no warning or error in the demo's output"
fi
grep -q "How to read the eval table above" "$WORK/lines" && grep -qE "greedy=|greedy" "$WORK/lines" \
  && grep -q "bench/RESULTS.md" "$WORK/lines" && ok "the output says what tau, speedup and greedy= mean and where GPU figures are" \
  || bad "demo's closing guide missing: $(tail -12 "$WORK/lines")"
for f in generated/generated.jsonl tokens/tokens.jsonl features/manifest.json train/checkpoint.safetensors \
         export-vllm/config.json export-sglang/config.json eval/eval.json eval/eval.html train/report.html; do
  [ -s "$WORK/demo/$f" ] || bad "demo left no $f"
done
ok "every output the demo names is there"
finish
