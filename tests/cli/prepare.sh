#!/usr/bin/env bash
# talon prepare: parity with transformers (committed expected outputs from tools/prepare_reference.py),
# the demo input, all of shared/data/train, extract + inspect on a prepared dir, bad inputs.
source "$(dirname "$0")/lib.sh"
FX=$SRC/tests/fixtures/prepare
GGUF=$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
SHARED=$SRC/../shared/data
QWEN_TPL=$SHARED/tokenizers/chat_templates/qwen2.5-instruct.jinja
QWEN3_TPL=$SHARED/tokenizers/chat_templates/qwen3.jinja

# same_as OUT EXPECTED NAME: tokens.jsonl of OUT equals EXPECTED on id, input_ids, loss_mask, line by line.
same_as() {
  python3 - "$1/tokens.jsonl" "$2" <<'PY'
import json, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
if len(a) != len(b):
    sys.exit(f"{len(a)} samples, expected {len(b)}")
for x, y in zip(a, b):
    for k in ("id", "input_ids", "loss_mask"):
        if x[k] != y[k]:
            d = [i for i, (p, q) in enumerate(zip(x[k], y[k])) if p != q][:5] if isinstance(x[k], list) else ""
            sys.exit(f"sample {y['id']}: {k} differs (len {len(x[k])} vs {len(y[k])}, first diffs at {d})")
print(f"{len(a)} samples identical")
PY
}
run() { "$TALON" --log-level warn "$@" > "$WORK/stdout" 2> "$WORK/stderr"; }

if [ ! -f "$GGUF" ]; then
  bad "$GGUF missing (scripts/setup.sh fetches it)"
  finish
fi

# 1. parity with transformers on SmolLM2 (GGUF) and Qwen2.5 (tokenizer.json + template)
for f in openai sharegpt; do
  rm -rf "$WORK/s"
  if run prepare --model "$GGUF" --data "$FX/chats_$f.jsonl" --out "$WORK/s" && r=$(same_as "$WORK/s" "$FX/expected_smollm2.jsonl" 2>&1); then
    ok "smollm2 $f parity with transformers: $r"
  else bad "smollm2 $f parity: ${r:-$(cat "$WORK/stderr")}"; fi
done
if [ -f "$SHARED/tokenizers/hf/qwen2/tokenizer.json.gz" ]; then
  zcat "$SHARED/tokenizers/hf/qwen2/tokenizer.json.gz" > "$WORK/qwen2.json"
  for f in openai sharegpt; do
    rm -rf "$WORK/q"
    if run prepare --tokenizer "$WORK/qwen2.json" --template "$QWEN_TPL" --data "$FX/chats_$f.jsonl" --out "$WORK/q" &&
       r=$(same_as "$WORK/q" "$FX/expected_qwen25.jsonl" 2>&1); then
      ok "qwen2.5 $f parity with transformers (NFC-normalizing tokenizer): $r"
    else bad "qwen2.5 $f parity: ${r:-$(cat "$WORK/stderr")}"; fi
  done
  # Qwen3 multi-turn: the template strips <think> blocks from turns before the last user query, so
  # earlier turns are located in the final rendering; expected outputs from tools/prepare_reference.py
  # --method qwen3-find (str.find of each rendered turn), thinking on (default) and off
  for kw in default nothink; do
    rm -rf "$WORK/q3"
    if [ $kw = nothink ]; then args=(--template-kwargs '{"enable_thinking": false}'); exp=expected_qwen3_nothink.jsonl
    else args=(); exp=expected_qwen3.jsonl; fi
    if run prepare --tokenizer "$WORK/qwen2.json" --template "$QWEN3_TPL" "${args[@]}" --data "$FX/chats_qwen3.jsonl" --out "$WORK/q3" &&
       r=$(same_as "$WORK/q3" "$FX/$exp" 2>&1); then
      ok "qwen3 multi-turn ($kw) parity with the str.find oracle: $r"
    else bad "qwen3 multi-turn ($kw) parity: ${r:-$(cat "$WORK/stderr")}"; fi
  done
  # no template and no fallback: refused; with --fallback-template chatml: loud warning, recorded
  rm -rf "$WORK/q"
  if run prepare --tokenizer "$WORK/qwen2.json" --data "$FX/chats_openai.jsonl" --out "$WORK/q"; then bad "no template: exit 0"
  elif grep -q 'fallback-template chatml' "$WORK/stderr" && [ ! -e "$WORK/q" ]; then ok "no template: refused, suggests --fallback-template"
  else bad "no template: $(cat "$WORK/stderr")"; fi
  "$TALON" prepare --tokenizer "$WORK/qwen2.json" --fallback-template chatml --data "$FX/chats_openai.jsonl" --out "$WORK/q" > /dev/null 2> "$WORK/stderr"
  if grep -q 'BUILT-IN ChatML' "$WORK/stderr" && python3 -c "import json,sys; m=json.load(open('$WORK/q/manifest.json')); sys.exit(not m['chat_template']['builtin_fallback'])"; then
    ok "fallback chatml: warned and recorded in the manifest"
  else bad "fallback chatml: $(tail -2 "$WORK/stderr")"; fi
else
  bad "qwen2 tokenizer missing under $SHARED"
fi

# 2. the demo conversations reproduce examples/demo_tokens.jsonl (tools/make_golden.py --demo)
rm -rf "$WORK/demo"
if run prepare --model "$GGUF" --data "$SRC/examples/demo_chats.jsonl" --out "$WORK/demo" && r=$(same_as "$WORK/demo" "$SRC/examples/demo_tokens.jsonl" 2>&1); then
  ok "demo_chats.jsonl -> demo_tokens.jsonl: $r"
else bad "demo: ${r:-$(cat "$WORK/stderr")}"; fi

# 3. all of shared/data/train: time, counts and sanity of every line
if [ -d "$SHARED/train" ]; then
  t0=$(date +%s.%N)
  if run prepare --model "$GGUF" --data "$SHARED/train" --out "$WORK/train"; then
    secs=$(python3 -c "print(round($(date +%s.%N) - $t0, 1))")
    if r=$(python3 - "$WORK/train" <<'PY' 2>&1
import json, sys, hashlib
d = sys.argv[1]
m = json.load(open(f"{d}/manifest.json"))
c = m["counts"]
assert m["format"] == "talon.tokens" and m["format_version"] == 1
assert hashlib.sha256(open(f"{d}/tokens.jsonl", "rb").read()).hexdigest() == m["tokens_sha256"], "sha256"
n = tok = masked = 0
for line in open(f"{d}/tokens.jsonl"):
    s = json.loads(line)
    ids, mask = s["input_ids"], s["loss_mask"]
    assert len(ids) == len(mask) and ids and all(0 <= t < 49152 for t in ids), s["id"]
    assert set(mask) <= {0, 1} and sum(mask) > 0, f"{s['id']}: no masked token"
    assert mask[0] == 0, f"{s['id']}: first token masked"
    n += 1; tok += len(ids); masked += sum(mask)
assert (n, tok, masked) == (c["samples"], c["tokens"], c["masked_tokens"]), "counts"
assert c["records"] == 7473 + 175 + 252 + 1000 + 1388 + 385, c["records"]
assert c["samples"] + c["skipped"] == c["records"], "every record is a sample or a counted skip"
sk = c["skipped_by_reason"]
assert set(sk) == {"prompt_only"} and sk["prompt_only"]["count"] == 385, sk.keys()
fm = {i["path"].split("/")[-1]: i["formats"] for i in m["inputs"]}
assert fm["sharegpt_1k.jsonl"] == {"sharegpt": 1000} and fm["ultra_eval.json"] == {"questions": 385}, fm
print(f"{n} samples, {tok} tokens, {masked} masked, skipped {dict((k, v['count']) for k, v in sk.items())}")
PY
    ); then
      ok "all of train/ in ${secs}s: $r"
    else bad "train stats: $r"; fi
    awk -v s="$secs" 'BEGIN { exit !(s < 300) }' && ok "train/ within 300 s (${secs}s)" || bad "train/ took ${secs}s"
  else bad "prepare train/: $(tail -3 "$WORK/stderr")"; fi
  # assistant-first ShareGPT segments are kept: their first turn is masked from its content on
  python3 - "$WORK/train/tokens.jsonl" "$SHARED/train/sharegpt_1k/sharegpt_1k.jsonl" > "$WORK/af" 2>&1 <<'PY'
import json, sys
first = {}
for l in open(sys.argv[2]):
    r = json.loads(l)
    if r["conversations"] and r["conversations"][0]["from"] == "gpt": first[r["id"]] = 1
kept = sum(1 for l in open(sys.argv[1]) if json.loads(l)["id"] in first)
print(len(first), kept)
PY
  read -r nfirst nkept < "$WORK/af"
  [ "$nfirst" = 338 ] && [ "$nkept" = 338 ] && ok "338 assistant-first ShareGPT segments kept" || bad "assistant-first: $(cat "$WORK/af")"
  # question files: --prompts keep emits them with an empty loss mask and a flag
  if [ -d "$SHARED/dev" ] && run prepare --model "$GGUF" --data "$SHARED/dev" --out "$WORK/dev" --prompts keep &&
     r=$(python3 - "$WORK/dev" <<'PY' 2>&1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/tokens.jsonl")]
assert len(rows) == 80 + 164 + 80 and all(r["prompt"] and sum(r["loss_mask"]) == 0 for r in rows)
assert sum(1 for r in rows if "later_turns" in r) == 80  # mt_bench: 2 turns each
print(len(rows), "prompts")
PY
     ); then ok "dev/ --prompts keep: $r"
  else bad "dev prompts: ${r:-$(tail -2 "$WORK/stderr")}"; fi
else
  bad "$SHARED/train missing"
fi

# 4. --max-length, then extract (SmolLM2, default layers) and inspect on the prepared directory
rm -rf "$WORK/short" "$WORK/feat"
if run prepare --model "$GGUF" --data "$SRC/examples/demo_chats.jsonl" --out "$WORK/short" --max-length 64 &&
   python3 -c "
import json,sys
m=json.load(open('$WORK/short/manifest.json')); rows=[json.loads(l) for l in open('$WORK/short/tokens.jsonl')]
sk=m['counts']['skipped_by_reason'].get('no_loss_after_truncation',{}).get('count',0)
assert all(len(r['input_ids'])==64 and len(r['loss_mask'])==64 and r['truncated'] and sum(r['loss_mask']) for r in rows)
assert m['counts']['truncated']==len(rows)==4 and sk==4, m['counts']  # 4 GSM8K prompts fill the 64 tokens"; then
  ok "--max-length 64: ids and masks truncated together; 4 truncated, 4 without loss tokens skipped"
else bad "--max-length: $(tail -2 "$WORK/stderr")"; fi
if run extract --model "$GGUF" --data "$WORK/short" --out "$WORK/feat" &&
   python3 -c "
import json; m=json.load(open('$WORK/feat/manifest.json'))
assert m['input_format']=='talon.tokens' and m['status']=='complete' and m['num_samples']>0, m['input_format']"; then
  ok "extract reads the prepared directory ($(head -1 "$WORK/stdout"))"
else bad "extract on prepared dir: $(tail -3 "$WORK/stderr")"; fi
run inspect "$WORK/demo" --sample 7
if grep -q 'talon.tokens' "$WORK/stdout"; then
  if grep -q 'checksum ok' "$WORK/stdout" && grep -q '^\[\[' "$WORK/stdout" && grep -qF '<|im_end|>]]' "$WORK/stdout"; then ok "inspect shows stats and masked spans"
  else bad "inspect output: $(head -5 "$WORK/stdout")"; fi
else
  bad "talon inspect did not recognise the prepared directory: $(head -3 "$WORK/stdout")"
fi

# 5. bad inputs: file:line errors, non-zero exit, nothing left in --out; --on-error skip counts them
P=(prepare --model "$GGUF" --out "$WORK/out")
G='{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'
expect() {  # expect NAME PATTERN -- args
  local name=$1 pat=$2; shift 3
  rm -rf "$WORK/out"
  "$TALON" "$@" > "$WORK/stdout" 2> "$WORK/stderr"
  local rc=$? msg; msg=$(grep '^error: ' "$WORK/stderr" | head -1)
  if [ $rc -eq 0 ]; then bad "$name: exit 0"; return; fi
  if ! grep -qE -- "$pat" <<< "$msg"; then bad "$name: error '$msg' does not match /$pat/"; return; fi
  if [ -e "$WORK/out" ]; then bad "$name: left $WORK/out: $(ls -A "$WORK/out")"; return; fi
  ok "$name: $msg"
}
printf '%s\n' "$G" 'not json' "$G" > "$WORK/b1.jsonl"
expect malformed-line 'b1.jsonl:2: not valid JSON' -- "${P[@]}" --data "$WORK/b1.jsonl"
{ printf '%s\n' "$G"; printf '{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'; } > "$WORK/b2.jsonl"
expect invalid-utf8 'b2.jsonl:2: invalid UTF-8 at byte' -- "${P[@]}" --data "$WORK/b2.jsonl"
printf '%s\n' '{"foo": 1}' > "$WORK/b3.jsonl"
expect unknown-shape "b3.jsonl:1: no known chat record shape \(keys: foo\)" -- "${P[@]}" --data "$WORK/b3.jsonl"
printf '%s\n' '{"conversations": [{"from": "narrator", "value": "x"}]}' > "$WORK/b4.jsonl"
expect unknown-role "b4.jsonl:1: conversations\[0\]: unknown speaker 'narrator'" -- "${P[@]}" --data "$WORK/b4.jsonl"
printf '[{"question": "q", "answer": "a"},\n {"question": "q2", "answer": ' > "$WORK/b5.json"
expect broken-array "b5.json: line 2: the JSON array is not closed" -- "${P[@]}" --data "$WORK/b5.json"
printf '%s\n' '{"question": "q"}' > "$WORK/b6.jsonl"
expect only-prompts "no samples from 1 records \(1 skipped\)" -- "${P[@]}" --data "$WORK/b6.jsonl"
expect missing-input 'absent.jsonl: no such file' -- "${P[@]}" --data "$WORK/absent.jsonl"
expect bad-on-error "--on-error 'maybe'" -- "${P[@]}" --data "$WORK/b1.jsonl" --on-error maybe
mkdir -p "$WORK/full" && touch "$WORK/full/x"
if "$TALON" prepare --model "$GGUF" --data "$WORK/b6.jsonl" --out "$WORK/full" 2> "$WORK/stderr"; then bad "non-empty --out: exit 0"
elif grep -q 'not empty' "$WORK/stderr" && [ "$(ls -A "$WORK/full")" = x ]; then ok "non-empty --out refused, left untouched"
else bad "non-empty --out: $(cat "$WORK/stderr")"; fi
rm -rf "$WORK/out"
cat "$WORK/b1.jsonl" "$WORK/b2.jsonl" "$WORK/b3.jsonl" > "$WORK/mixed.jsonl"
if run "${P[@]}" --data "$WORK/mixed.jsonl" --on-error skip && python3 -c "
import json; m=json.load(open('$WORK/out/manifest.json')); c=m['counts']; r=c['skipped_by_reason']
assert c['samples']==3 and c['skipped']==3, c
assert {k: v['count'] for k, v in r.items()} == {'invalid_json': 1, 'invalid_utf8': 1, 'unrecognised_record': 1}, r
assert any('mixed.jsonl:2' in e for e in r['invalid_json']['examples'])"; then
  ok "--on-error skip: 3 bad records counted by reason with file:line"
else bad "--on-error skip: $(tail -2 "$WORK/stderr")"; fi

# 6. Ctrl-C: exits 130 and leaves nothing behind
if [ -d "$SHARED/train" ]; then
  rm -rf "$WORK/int"
  "$TALON" prepare --model "$GGUF" --data "$SHARED/train" "$SHARED/train" "$SHARED/train" --out "$WORK/int" --threads 1 > /dev/null 2>&1 &
  pid=$!
  sleep 1.5
  kill -INT $pid
  wait $pid
  rc=$?
  if [ $rc -eq 130 ] && [ ! -e "$WORK/int" ]; then ok "SIGINT: exit 130, no output left"
  else bad "SIGINT: rc $rc, out: $(ls -A "$WORK/int" 2>&1)"; fi
fi
finish
