#!/usr/bin/env bash
# The threaded code with a tiny model (fast enough for ThreadSanitizer builds): extract's
# pipeline (loader, compute, allocator and writer threads) over many small shards,
# uninterrupted, stopped by SIGINT and resumed, killed and resumed, and as two concurrent
# ranks; offline training with its feature prefetch thread, stopped and resumed; the
# tokenize thread pool against one thread. Outputs must be identical.
source "$(dirname "$0")/lib.sh"
MODEL=$SRC/tests/fixtures/golden/llama_gqa
tokens 60 97 5 6 > "$WORK/t.jsonl"
args=(--model "$MODEL" --data "$WORK/t.jsonl" --layers 1,2,3 --shard-tokens 24 --max-batch-tokens 16 --threads 2)
same() { diff -r -x '.talon*' -x 'progress.rank-*' "$WORK/ref" "$1" > "$WORK/diff" 2>&1; }

"$TALON" extract "${args[@]}" --out "$WORK/ref" > /dev/null 2> "$WORK/e" && ok "extract: uninterrupted" || bad "extract: $(tail -2 "$WORK/e")"
n=$(ls "$WORK"/ref/shard-*.safetensors | wc -l)
[ "$n" -ge 12 ] && ok "$n shards (several writer threads busy)" || bad "only $n shards"
"$TALON" inspect "$WORK/ref" > "$WORK/i" 2>&1 && ok "inspect verifies it" || bad "inspect: $(tail -2 "$WORK/i")"

"$TALON" extract "${args[@]}" --out "$WORK/hook" --stop-after-shards 4 > /dev/null 2> "$WORK/e"
[ $? -ne 0 ] && grep -q "resume with:" "$WORK/e" && ok "stopped after a few shards with a resume hint" || bad "stop: $(tail -2 "$WORK/e")"
"$TALON" extract "${args[@]}" --out "$WORK/hook" > /dev/null 2> "$WORK/e"
same "$WORK/hook" && ok "stop + resume: identical" || bad "stop + resume differs: $(head -3 "$WORK/diff")"

"$TALON" extract "${args[@]}" --out "$WORK/k9" > /dev/null 2>&1 &
pid=$!
wait_recorded "$WORK/k9/manifest.json" 2 400 0.01
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
"$TALON" extract "${args[@]}" --out "$WORK/k9" > /dev/null 2> "$WORK/e"
same "$WORK/k9" && ok "kill -9 + resume: identical" || bad "kill -9 + resume differs: $(head -3 "$WORK/diff") $(tail -2 "$WORK/e")"

"$TALON" extract "${args[@]}" --out "$WORK/ranks" --rank 1 --world 2 > /dev/null 2> "$WORK/e1" &
p1=$!
"$TALON" extract "${args[@]}" --out "$WORK/ranks" --rank 0 --world 2 > /dev/null 2> "$WORK/e0"
r0=$?
wait $p1; r1=$?
[ $r0 -eq 0 ] && [ $r1 -eq 0 ] || bad "ranks: rc $r0/$r1: $(tail -1 "$WORK/e0") $(tail -1 "$WORK/e1")"
# rank 0 may finish first and leave the merge to a rerun
grep -q '"complete"' "$WORK/ranks/manifest.json" || "$TALON" extract "${args[@]}" --out "$WORK/ranks" > /dev/null 2>&1
same "$WORK/ranks" && ok "two concurrent ranks: identical" || bad "ranks differ: $(head -3 "$WORK/diff")"

# Offline training reads the next step's features on a helper thread: a run stopped at a
# step boundary (its prefetch abandoned) and resumed logs the losses of an uninterrupted run.
targs=(--data "$WORK/ref" --model "$MODEL" --draft-vocab 32 --max-length 64 --ttt-steps 2 --max-steps 6
       --batch-samples 3 --seed 3)
"$TALON" train "${targs[@]}" --out "$WORK/tr" > /dev/null 2> "$WORK/e" && ok "train: uninterrupted" || bad "train: $(tail -2 "$WORK/e")"
"$TALON" train "${targs[@]}" --out "$WORK/tr2" --stop-after-steps 2 > /dev/null 2> "$WORK/e"
[ $? -ne 0 ] && grep -q "resume with:" "$WORK/e" && ok "train: stopped after 2 steps with a resume hint" || bad "train stop: $(tail -2 "$WORK/e")"
"$TALON" train "${targs[@]}" --out "$WORK/tr2" > /dev/null 2> "$WORK/e" || bad "train resume: $(tail -2 "$WORK/e")"
[ -s "$WORK/tr/metrics.jsonl" ] && [ "$(losses "$WORK/tr2/metrics.jsonl")" = "$(losses "$WORK/tr/metrics.jsonl")" ] &&
  ok "train: stop + resume, identical losses" || bad "train losses differ: $(losses "$WORK/tr2/metrics.jsonl") vs $(losses "$WORK/tr/metrics.jsonl")"

python3 - > "$WORK/texts.jsonl" <<'PY'
import json, random
r = random.Random(3)
words = ["hello", "world", " ", "caf\u00e9", "\u4e2d\u6587", "12345", "\n", "The", "quick", "<|im_end|>"]
for i in range(300):
    print(json.dumps({"text": "".join(r.choice(words) for _ in range(r.randrange(1, 40)))}))
PY
TOK=$SRC/tests/fixtures/tokenizers/bytelevel_tiny.json
"$TALON" tokenize --tokenizer "$TOK" --input "$WORK/texts.jsonl" --output "$WORK/t1.jsonl" --threads 1 > /dev/null 2> "$WORK/e" || bad "tokenize 1 thread: $(tail -2 "$WORK/e")"
"$TALON" tokenize --tokenizer "$TOK" --input "$WORK/texts.jsonl" --output "$WORK/t4.jsonl" --threads 4 > /dev/null 2> "$WORK/e" || bad "tokenize 4 threads: $(tail -2 "$WORK/e")"
[ -s "$WORK/t1.jsonl" ] && cmp -s "$WORK/t1.jsonl" "$WORK/t4.jsonl" && ok "tokenize: 4 threads == 1 thread ($(wc -l < "$WORK/t4.jsonl") lines)" || bad "tokenize outputs differ"
finish
