# Shared helpers for the CLI scenario tests. Usage: source lib.sh; args: TALON SRC_DIR.
set -uo pipefail
TALON=$1
SRC=$2
WORK=$(mktemp -d /tmp/talon-cli-XXXXXX)
trap 'rm -rf "$WORK"' EXIT
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
