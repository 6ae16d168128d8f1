# Sourced by the GPU training checks: gqa_features TALON DIR SEED N MIN SPAN writes N synthetic
# token samples (lengths MIN..MIN+SPAN-1, loss mask from a third of each on) of the
# tests/fixtures/golden/llama_gqa target to DIR/tok.jsonl and extracts their features (CPU,
# aux layers 0,1,2) into DIR/feat.
gqa_features() {
  local t=$1 dir=$2 seed=$3 n=$4 lo=$5 span=$6
  python3 - "$seed" "$n" "$lo" "$span" > "$dir/tok.jsonl" <<'PY'
import json, random, sys
seed, n, lo, span = map(int, sys.argv[1:5])
r = random.Random(seed)
for i in range(n):
    t = lo + r.randrange(span)
    print(json.dumps({"id": f"s{i}", "input_ids": [r.randrange(97) for _ in range(t)],
                      "loss_mask": [int(k >= t // 3) for k in range(t)]}))
PY
  "$t" extract --model tests/fixtures/golden/llama_gqa --data "$dir/tok.jsonl" --out "$dir/feat" --device cpu \
    --layers 0,1,2 > /dev/null 2>&1
}
