#!/usr/bin/env bash
# talon generate and talon eval end to end on SmolLM2 (CPU):
# * generate regenerates every assistant turn of mixed-format chat data in context; its
#   output goes through `talon prepare`; greedy output does not depend on the batch size;
# * a kill -9 mid-run and a SIGTERM both resume to output identical to an uninterrupted run,
#   with no conversation lost or written twice; another job on the same --out is refused;
# * eval (greedy, chain and tree) reproduces target-only decoding token for token, writes
#   eval.json / eval.html, and an fp32 speculators export of the draft gives the same
#   acceptance figures as the checkpoint it came from.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
DATA=$SRC/../shared/data
# Mixed formats: ShareGPT (a record opening with an assistant turn), questions (two turns), gsm8k.
cat > "$WORK/chats.jsonl" <<'J'
{"id": "sg1", "conversations": [{"from": "gpt", "value": "(the end of an earlier conversation)"}, {"from": "human", "value": "Name a colour."}, {"from": "gpt", "value": "Blue."}, {"from": "human", "value": "And another?"}, {"from": "gpt", "value": "Red."}]}
{"question_id": 7, "category": "writing", "turns": ["Write one sentence about the sea.", "Now make it shorter."]}
{"question": "What is 12 + 30?", "answer": "42"}
{"id": "sys", "messages": [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris"}]}
{"id": "q5", "turns": ["Say hello."]}
J
gen=(generate --model "$GGUF" --data "$WORK/chats.jsonl" --max-new-tokens 24)
"$TALON" "${gen[@]}" --batch 3 --out "$WORK/g_ref" > "$WORK/g.out" 2> "$WORK/g.err" && ok "generate completes" \
  || bad "generate: $(tail -3 "$WORK/g.err")"
python3 - "$WORK/g_ref" <<'PY' && ok "generated: every user turn answered in context, leading assistant turn dropped" || bad "generated output"
import json, sys
d = sys.argv[1]
rows = [json.loads(l) for l in open(d + "/generated.jsonl")]
assert [r["id"] for r in rows] == ["sg1", "7", "chats.jsonl:3", "sys", "q5"], [r["id"] for r in rows]
roles = {r["id"]: [m["role"] for m in r["messages"]] for r in rows}
assert roles["sg1"] == ["user", "assistant", "user", "assistant"], roles["sg1"]
assert roles["7"] == ["user", "assistant", "user", "assistant"], roles["7"]
assert roles["sys"] == ["system", "user", "assistant"], roles["sys"]
for r in rows:
    for m in r["messages"]:
        assert m["content"] not in ("Blue.", "Red.", "Paris", "42"), "an original answer was kept"
    assert all(m["content"].strip() for m in r["messages"] if m["role"] == "assistant"), r
m = json.load(open(d + "/manifest.json"))
assert m["counts"]["written"] == 5 and m["counts"]["leading_assistant_turns_dropped"] == 1, m["counts"]
PY
# inspect: the job, the counts and the output's digest; a changed output is caught.
"$TALON" inspect "$WORK/g_ref" > "$WORK/i.out" 2>&1 && grep -q "^generated answers" "$WORK/i.out" \
  && grep -q "5 written" "$WORK/i.out" && grep -q "sha256 verified" "$WORK/i.out" && grep -q "^next: talon prepare" "$WORK/i.out" \
  && ok "inspect summarises a generate directory" || bad "inspect generate: $(head -5 "$WORK/i.out")"
cp -r "$WORK/g_ref" "$WORK/g_changed" && echo '{}' >> "$WORK/g_changed/generated.jsonl"
"$TALON" inspect "$WORK/g_changed" > "$WORK/i2.out" 2>&1
[ $? -ne 0 ] && grep -q "sha256 MISMATCH" "$WORK/i2.out" && ok "inspect: a changed generate output fails" \
  || bad "inspect changed: $(head -8 "$WORK/i2.out")"
"$TALON" prepare --model "$GGUF" --data "$WORK/g_ref/generated.jsonl" --out "$WORK/g_tok" > /dev/null 2> "$WORK/p.err" \
  && ok "prepare reads the generated data" || bad "prepare: $(tail -3 "$WORK/p.err")"

# The batch size does not change greedy output (per-row arithmetic is independent of packing).
"$TALON" "${gen[@]}" --batch 1 --out "$WORK/g_b1" > /dev/null 2>&1
cmp -s "$WORK/g_ref/generated.jsonl" "$WORK/g_b1/generated.jsonl" && ok "batch 1 == batch 3" || bad "batch size changed the output"
# Nor does prefilling each prompt in chunks of 7 tokens beside the other slots' decode steps
# (every templated prompt here is longer than 7), greedy and sampled.
"$TALON" "${gen[@]}" --batch 3 --max-prefill-tokens 7 --out "$WORK/g_chunk" > /dev/null 2>&1
cmp -s "$WORK/g_ref/generated.jsonl" "$WORK/g_chunk/generated.jsonl" && ok "prompts prefilled in chunks: same output" \
  || bad "chunked prefill changed the output"
# A KV cache smaller than batch x max-len (128 rows in pages of 16 for 3 slots): turns wait for
# room instead of failing a forward, fewer run at once, and the output is the same.
"$TALON" "${gen[@]}" --batch 3 --max-len 128 --kv-cache-tokens 128 --out "$WORK/g_kv" > /dev/null 2> "$WORK/kv.err" \
  || bad "generate with a small KV cache: $(tail -3 "$WORK/kv.err")"
python3 - "$WORK/g_kv/manifest.json" <<'PY' && cmp -s "$WORK/g_ref/generated.jsonl" "$WORK/g_kv/generated.jsonl" \
  && ok "a KV cache smaller than batch x max-len: turns wait for room, same output" || bad "small KV cache: $(cat "$WORK/g_kv/manifest.json" 2>/dev/null | head -c 600)"
import json, sys
m = json.load(open(sys.argv[1]))
kv = m["kv_cache"]
assert kv["tokens"] == 128 and kv["page_tokens"] == 16 and kv["slots"] == 3, kv
assert 1 <= kv["peak_running"] < 3 and kv["forwards_with_a_turn_waiting_for_room"] > 0, kv
assert m["counts"]["turns_cut_by_max_len"] == 0, m["counts"]
PY
"$TALON" "${gen[@]}" --max-len 128 --kv-cache-tokens 100 --out "$WORK/g_kv_small" > /dev/null 2> "$WORK/kvs.err"
[ $? -ne 0 ] && grep -q "cannot hold one sequence of max_len 128" "$WORK/kvs.err" && [ ! -e "$WORK/g_kv_small" ] \
  && ok "a KV cache below one max-len sequence is refused before anything is written" || bad "$(cat "$WORK/kvs.err")"
"$TALON" "${gen[@]}" --tp 2 --out "$WORK/g_tp" > /dev/null 2> "$WORK/tp.err"
[ $? -ne 0 ] && grep -q "\-\-tp 2 needs --device cuda" "$WORK/tp.err" && [ ! -e "$WORK/g_tp" ] \
  && ok "--tp on the CPU is refused before anything is written" || bad "$(cat "$WORK/tp.err")"
"$TALON" "${gen[@]}" --batch 3 --temperature 0.8 --seed 3 --out "$WORK/g_t1" > /dev/null 2>&1
"$TALON" "${gen[@]}" --batch 2 --temperature 0.8 --seed 3 --max-prefill-tokens 5 --out "$WORK/g_t1c" > /dev/null 2>&1
[ -s "$WORK/g_t1/generated.jsonl" ] && cmp -s "$WORK/g_t1/generated.jsonl" "$WORK/g_t1c/generated.jsonl" \
  && ok "sampled: chunked prefill and another batch draw the same tokens" || bad "sampled output changed with chunking"

# kill -9 once the first conversations are journaled, then rerun.
"$TALON" "${gen[@]}" --batch 2 --out "$WORK/g_kill" > /dev/null 2>&1 &
pid=$!
for i in $(seq 1 600); do
  [ -s "$WORK/g_kill/progress.jsonl" ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.05
done
kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
had=$(wc -l < "$WORK/g_kill/progress.jsonl" 2>/dev/null || echo 0)
"$TALON" "${gen[@]}" --batch 2 --out "$WORK/g_kill" > /dev/null 2> "$WORK/k.err"
if cmp -s "$WORK/g_ref/generated.jsonl" "$WORK/g_kill/generated.jsonl"; then
  ok "kill -9 after $had journaled conversation(s), rerun: output identical"
else
  bad "kill -9 + rerun differs: $(tail -3 "$WORK/k.err")"
fi
ids=$(python3 -c "import json,sys; r=[json.loads(l)['id'] for l in open(sys.argv[1])]; print(len(r), len(set(r)))" "$WORK/g_kill/generated.jsonl")
[ "$ids" = "5 5" ] && ok "no conversation lost or duplicated" || bad "ids: $ids"

# SIGTERM: exit 143 with a resume hint; the rerun finishes.
"$TALON" "${gen[@]}" --batch 2 --out "$WORK/g_term" > /dev/null 2> "$WORK/t.err" &
pid=$!
for i in $(seq 1 600); do
  [ -s "$WORK/g_term/progress.jsonl" ] && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.05
done
kill -TERM $pid 2>/dev/null; wait $pid; rc=$?
if [ $rc -eq 143 ] && grep -q "resume with:" "$WORK/t.err"; then
  "$TALON" "${gen[@]}" --batch 2 --out "$WORK/g_term" > /dev/null 2>&1
  cmp -s "$WORK/g_ref/generated.jsonl" "$WORK/g_term/generated.jsonl" && ok "SIGTERM: exit 143, rerun identical" \
    || bad "SIGTERM rerun differs"
elif [ $rc -eq 0 ]; then
  ok "SIGTERM arrived after the run finished (nothing to check)"
else
  bad "SIGTERM: rc $rc: $(tail -3 "$WORK/t.err")"
fi
"$TALON" "${gen[@]}" --batch 2 --out "$WORK/g_ref" > "$WORK/again.out" 2>&1 && grep -q "already complete" "$WORK/again.out" \
  && ok "rerun of a finished job: nothing to do" || bad "rerun: $(tail -2 "$WORK/again.out")"
"$TALON" generate --model "$GGUF" --data "$WORK/chats.jsonl" --max-new-tokens 25 --out "$WORK/g_ref" > /dev/null 2> "$WORK/d.err"
[ $? -ne 0 ] && grep -q "holds a different generate job (max_new_tokens differ)" "$WORK/d.err" && ok "another job refused" \
  || bad "$(cat "$WORK/d.err")"
echo '{"conversations": "not a list"}' > "$WORK/bad.jsonl"
"$TALON" generate --model "$GGUF" --data "$WORK/bad.jsonl" --out "$WORK/g_bad" > /dev/null 2> "$WORK/b.err"
[ $? -ne 0 ] && grep -q "bad.jsonl:1" "$WORK/b.err" && ok "bad record named by file:line" || bad "$(cat "$WORK/b.err")"

# eval: a short training run gives a draft; greedy chain and tree speculation equal the target.
demo_features "$WORK" || bad "prepare + extract of the demo chats"
"$TALON" train --data "$WORK/feat" --model "$GGUF" --draft-vocab 1024 --max-length 64 --ttt-steps 3 --lr 1e-3 \
  --max-steps 3 --out "$WORK/run" > /dev/null 2> "$WORK/tr.err" || bad "train: $(tail -3 "$WORK/tr.err")"
ev=(eval --model "$GGUF" --data "$WORK/chats.jsonl" --limit 3 --max-new-tokens 16 --chain 2 --tree "3,3,6")
"$TALON" "${ev[@]}" --draft "$WORK/run" --out "$WORK/ev" > "$WORK/ev.out" 2> "$WORK/ev.err" \
  && ok "eval: greedy speculation equals target-only decoding ($(grep -c ' all ' "$WORK/ev.out") configs)" \
  || bad "eval: $(tail -5 "$WORK/ev.out" "$WORK/ev.err")"
python3 - "$WORK/ev/eval.json" <<'PY' && ok "eval.json: tau, per-depth rates, speedup, categories" || bad "eval.json"
import json, sys
d = json.load(open(sys.argv[1]))
rows = d["results"]
cats = {r["category"] for r in rows}
assert {"all", "writing"} <= cats, cats
for r in rows:
    s = r["speculative"]
    assert r["greedy_equal"]["differ"] == 0 and r["greedy_equal"]["compared"] == r["turns"] > 0, r
    assert s["tau"] >= 1.0 and len(s["accept_rate_per_depth"]) >= 2, s
    assert s["target_passes"] > 0 and r["baseline"]["new_tokens"] == s["new_tokens"], r
    assert r["speedup"] > 0
    # Round costs: rounds after the prefill, their target passes, the break-even tau.
    b = r["baseline"]
    assert 0 < s["round_seconds"] <= s["seconds"] and 0 < s["round_target_seconds"] <= s["round_seconds"], s
    assert b["round_target_seconds"] == b["round_seconds"] > 0 and b["draft_ms"] == 0, b
    assert abs(s["verify_ms"] + s["draft_ms"] - s["round_ms"]) <= 1e-9 * s["round_ms"], s
    assert abs(s["round_ms"] - 1e3 * s["round_seconds"] / s["target_passes"]) <= 1e-9 * s["round_ms"], s
    assert abs(r["break_even_tau"] * b["round_ms"] - s["round_ms"]) <= 1e-9 * s["round_ms"], r
PY
grep -q "<svg" "$WORK/ev/eval.html" && ok "eval.html has charts" || bad "eval.html"
python3 "$SRC/tests/cli/check_charts.py" "$WORK/ev/eval.html" "$WORK" 3 > "$WORK/charts.out" 2>&1 \
  && grep -q 'data-ref="1"' "$WORK/ev/eval.html" \
  && ok "eval charts render in headless Chromium, speedup has its 1.0 line ($(grep -c '^ok' "$WORK/charts.out"))" \
  || bad "eval charts: $(grep -v '^ok' "$WORK/charts.out" | head -5)"
"$TALON" inspect "$WORK/ev" > "$WORK/iev.out" 2>&1 || bad "inspect eval: $(tail -3 "$WORK/iev.out")"
python3 - "$WORK/ev/eval.json" "$WORK/iev.out" <<'PY' && ok "inspect: one table row per eval.json result" || bad "inspect eval: $(head -12 "$WORK/iev.out")"
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
out = open(sys.argv[2]).read().splitlines()
assert out[0].startswith("evaluation "), out[0]
table = [l.split() for l in out if l.strip() and l.split()[0].replace(".", "").isdigit()]
assert len(table) == len(rows), (len(table), len(rows))
for t, r in zip(table, rows):
    assert t[1] == r["config"] and t[2] == r["category"] and abs(float(t[4]) - r["tau"]) < 6e-4, (t, r)
    assert abs(float(t[6]) - r["break_even_tau"]) < 6e-3, (t, r)
PY
"$TALON" export --checkpoint "$WORK/run" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format speculators --dtype fp32 --out "$WORK/exp" > /dev/null 2>&1 \
  || bad "export"
"$TALON" "${ev[@]}" --draft "$WORK/exp" --out "$WORK/ev2" > /dev/null 2> "$WORK/ev2.err" || bad "eval export: $(tail -3 "$WORK/ev2.err")"
python3 - "$WORK/ev/eval.json" "$WORK/ev2/eval.json" <<'PY' && ok "fp32 export: same acceptance as the checkpoint" || bad "export eval differs"
import json, sys
a, b = (json.load(open(p))["results"] for p in sys.argv[1:])
key = lambda r: (r["temperature"], r["config"], r["category"], r["speculative"]["accepted_per_depth"], r["speculative"]["new_tokens"])
assert [key(r) for r in a] == [key(r) for r in b], ([key(r) for r in a], [key(r) for r in b])
PY
"$TALON" "${ev[@]}" --draft "$SRC/tests/fixtures/golden/llama_gqa" --out "$WORK/ev3" > /dev/null 2> "$WORK/ev3.err"
[ $? -ne 0 ] && grep -q "config.json" "$WORK/ev3.err" && ok "a directory that is not a draft is refused" || bad "$(cat "$WORK/ev3.err")"
finish
