# Shared helpers for the CLI scenario tests. Usage: source lib.sh; args: TALON SRC_DIR.
set -uo pipefail
TALON=$1
SRC=$2
WORK=$(mktemp -d /tmp/talon-cli-XXXXXX)
# Under scripts/sanitize.sh (TALON_SANITIZER_REPORTS set): sanitizer reports that reached a
# file of this test (stderr captured to $WORK) are kept there before $WORK goes, so a report
# from a run that was expected to fail is not lost (UBSan in GCC builds writes only to stderr).
keep_reports() {
  [ -n "${TALON_SANITIZER_REPORTS:-}" ] || return 0
  grep -rlE "runtime error:|ERROR: (Address|Leak|Thread)Sanitizer|WARNING: ThreadSanitizer" "$WORK" 2>/dev/null |
    while read -r f; do cp "$f" "$TALON_SANITIZER_REPORTS/$(basename "$0" .sh).$(basename "$f").$$"; done
}
trap 'keep_reports; rm -rf "$WORK"' EXIT
FAILS=0
PASSES=0
ok() { PASSES=$((PASSES + 1)); echo "ok   - $*"; }
bad() { FAILS=$((FAILS + 1)); echo "FAIL - $*"; }
finish() {
  echo "$PASSES passed, $FAILS failed"
  [ "$FAILS" -eq 0 ]
  exit $?
}
# tokens N V SEED LEN: N JSONL samples of LEN.. tokens below V with a loss mask on the second half.
tokens() {
  python3 - "$@" <<'PY'
import json, random, sys
n, v, seed, ln = map(int, sys.argv[1:5])
r = random.Random(seed)
for i in range(n):
    t = ln + r.randrange(ln)
    ids = [r.randrange(v) for _ in range(t)]
    print(json.dumps({"id": f"s{i}", "input_ids": ids, "loss_mask": [int(k >= t // 2) for k in range(t)]}))
PY
}
# wait_recorded FILE N [TRIES] [STEP]: until FILE (a manifest or progress file) lists at
# least N shards, polling every STEP seconds (default 0.05) at most TRIES times (600).
wait_recorded() {
  local f=$1 want=$2 tries=${3:-600} step=${4:-0.05} i n
  for i in $(seq 1 "$tries"); do
    n=$(grep -c '"sha256"' "$f" 2>/dev/null || true)
    [ "${n:-0}" -ge "$want" ] && return 0
    sleep "$step"
  done
  return 0
}
# demo_features DIR: DIR/tok and DIR/feat, SmolLM2's prepare + extract of
# examples/demo_chats.jsonl. Copied from the ctest run's shared fixture (fixture.demo_features,
# TALON_FIXTURE_DIR) when it is there, else made here, so each script also runs alone.
demo_features() {
  local d=$1 g=${GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
  if [ -n "${TALON_FIXTURE_DIR:-}" ] && [ -f "$TALON_FIXTURE_DIR/feat/manifest.json" ] &&
     grep -q '"complete"' "$TALON_FIXTURE_DIR/feat/manifest.json"; then
    cp -r "$TALON_FIXTURE_DIR/tok" "$TALON_FIXTURE_DIR/feat" "$d/" && rm -f "$d"/tok/.talon*.lock "$d"/feat/.talon*.lock &&
      return 0
  fi
  TALON_SMOLLM2_GGUF=$g bash "$SRC/tests/cli/fixture/demo_features.sh" "$TALON" "$SRC" "$d/demo" > /dev/null 2>&1 &&
    mv "$d/demo/tok" "$d/demo/feat" "$d/" && rmdir "$d/demo"
}
# losses FILE: the exact losses of a metrics.jsonl, one line, space-separated.
losses() { python3 -c "import json,sys; print(' '.join(json.loads(l)['loss_exact'] for l in open(sys.argv[1])))" "$1"; }
# stop_resume_checked DIR REF WHAT ARGS...: `talon train ARGS --out DIR` stopped after 3 steps
# must exit nonzero with a resume hint (stderr in DIR.err); run again, it must resume at step 3
# and end with exactly the losses REF (WHAT: what else had to repeat, for the message).
stop_resume_checked() {
  local dir=$1 ref=$2 what=$3 rc
  shift 3
  "$TALON" train "$@" --out "$dir" --stop-after-steps 3 > /dev/null 2> "$dir.err"
  rc=$?
  [ $rc -ne 0 ] && grep -q "resume with: .*train" "$dir.err" && ok "stopped run exits $rc with a resume hint" \
    || bad "stop: rc $rc $(tail -2 "$dir.err")"
  "$TALON" train "$@" --out "$dir" > /dev/null 2> "$dir.2.err"
  grep -q "resuming from .* at step 3 of" "$dir.2.err" && ok "resumed at step 3" || bad "$(grep -i resum "$dir.2.err")"
  [ "$(losses "$dir/metrics.jsonl")" = "$ref" ] && ok "stop + resume: identical losses$what" \
    || bad "losses differ: $(losses "$dir/metrics.jsonl") vs $ref"
}
# stop_checked DIR PID ERR WHAT WAIT: `talon stop DIR --wait WAIT` must signal exactly PID,
# which exits 143 (or 0 when it had finished) having printed a resume hint to ERR.
stop_checked() {
  local dir=$1 pid=$2 err=$3 what=$4 wait_s=$5 src rc
  "$TALON" stop "$dir" --wait "$wait_s" > "$WORK/stop.out" 2>&1
  src=$?
  wait "$pid"; rc=$?
  if [ $src -eq 0 ] && grep -q "sent SIGTERM to pid $pid" "$WORK/stop.out" && { [ $rc -eq 143 ] || [ $rc -eq 0 ]; }; then
    ok "talon stop ($what): pid $pid exited $rc"
  else bad "talon stop ($what): stop rc $src, run rc $rc: $(cat "$WORK/stop.out")"; fi
  [ $rc -eq 0 ] || grep -q "resume with:" "$err" && ok "the stopped $what printed a resume hint" \
    || bad "no resume hint: $(tail -2 "$err")"
}
