#!/usr/bin/env bash
# Exact-parity test of `talon tokenize` against Hugging Face (tools/tokenizer_reference.py) on every
# text string of ../shared/data/{train,dev} (with TALON_TEST_FULL=1; else those with a non-ASCII
# character and every 5th other one) plus llama.cpp's vocab-test inputs, for each tokenizer
# family; and against llama.cpp's HF-generated ids (.out) as a second oracle. Every family must be
# 100% equal (encode ids, and decode(ids) == HF decode(ids)).
# Usage: bash tests/cli/tokenizer_parity.sh TALON SRC_DIR
source "$(dirname "$0")/lib.sh"
DATA="$SRC/../shared/data"
TOK="$DATA/tokenizers"
REF="$SRC/tools/tokenizer_reference.py"
if [ ! -d "$DATA/train" ] || [ ! -d "$TOK" ]; then
  # The test command (TALON_REQUIRE_MODEL=1) must not pass without its corpus.
  [ "${TALON_REQUIRE_MODEL:-0}" = 1 ] && { bad "$DATA/train or $TOK missing"; finish; }
  echo "skip: $DATA not present"
  exit 77
fi
python3 -c "import tokenizers, transformers, sentencepiece, google.protobuf, gguf" 2>/dev/null \
  || { bad "python packages missing: pip install tokenizers transformers sentencepiece protobuf gguf"; finish; }

# Corpus: every string value in every JSON/JSONL file under train/ and dev/ (deduplicated), plus
# the llama.cpp vocab-test inputs.
python3 - "$DATA" "$TOK/llamacpp_vocab_tests" "$WORK/corpus.jsonl" <<'PY'
import glob, json, os, sys
data, lc, out = sys.argv[1:4]
texts = []
def walk(v):
    if isinstance(v, str): texts.append(v)
    elif isinstance(v, list):
        for x in v: walk(x)
    elif isinstance(v, dict):
        for x in v.values(): walk(x)
for root in ("train", "dev"):
    for f in sorted(glob.glob(os.path.join(data, root, "**", "*"), recursive=True)):
        if f.endswith(".jsonl"):
            for line in open(f, encoding="utf-8"):
                if line.strip(): walk(json.loads(line))
        elif f.endswith(".json"):
            walk(json.load(open(f, encoding="utf-8")))
# The default test tier keeps every text with a non-ASCII character (where tokenizers
# differ most), every llama.cpp input and every 5th other text; TALON_TEST_FULL=1
# (scripts/test.sh --full, CI) keeps them all.
full = os.environ.get("TALON_TEST_FULL") == "1"
n_data = len(texts)
for f in sorted(glob.glob(os.path.join(lc, "*.inp"))):
    texts += open(f, encoding="utf-8").read().split("\n__ggml_vocab_test__\n")[:-1]
seen = set()
kept = 0
with open(out, "w", encoding="utf-8") as o:
    for i, t in enumerate(texts):
        if t not in seen:
            seen.add(t)
            if full or i >= n_data or any(ord(c) > 127 for c in t) or len(seen) % 5 == 0:
                kept += 1
                o.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
print(f"corpus: {kept} of {len(seen)} distinct texts ({len(texts)} strings){'' if full else ' (TALON_TEST_FULL=1: all)'}")
PY

# compare REF.jsonl TALON.jsonl NAME: ids equality, prints the first mismatches with their text.
compare() {
  python3 - "$@" <<'PY'
import json, sys
ref_f, got_f, name, field = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
ref = [json.loads(l) for l in open(ref_f, encoding="utf-8")]
got = [json.loads(l) for l in open(got_f, encoding="utf-8")]
if len(ref) != len(got):
    print(f"{name}: {len(ref)} reference lines but {len(got)} talon lines"); sys.exit(1)
eq, shown = 0, 0
for r, g in zip(ref, got):
    a, b = r[field], g["ids" if field == "ids" else "text"]
    if a == b:
        eq += 1
    elif shown < 5:
        shown += 1
        if field == "ids":
            k = next((i for i in range(min(len(a), len(b))) if a[i] != b[i]), min(len(a), len(b)))
            print(f"  mismatch: text={g.get('text', '')[:200]!r}\n    hf[{k}:]={a[k:k+10]}\n    talon[{k}:]={b[k:k+10]}")
        else:
            print(f"  decode mismatch: hf={a[:200]!r}\n    talon={b[:200]!r}")
print(f"{name}: {len(ref)} texts, {eq} equal")
sys.exit(0 if eq == len(ref) else 1)
PY
}

# family NAME TOKENIZER [REF_ARGS...]
family() {
  local name=$1 tok=$2
  shift 2
  if [ ! -e "$tok" ]; then bad "$name: $tok missing"; return; fi
  # REF_TOK (optional): the reference's tokenizer when it differs from talon's (tiktoken).
  if ! python3 "$REF" "$@" "${REF_TOK:-$tok}" "$WORK/corpus.jsonl" "$WORK/$name.ref.jsonl" 2>"$WORK/$name.ref.err"; then
    bad "$name: reference failed: $(tail -3 "$WORK/$name.ref.err")"; return
  fi
  if ! "$TALON" tokenize --tokenizer "$tok" --input "$WORK/corpus.jsonl" --output "$WORK/$name.out.jsonl" \
      --threads 2 2>"$WORK/$name.err"; then
    bad "$name: talon tokenize failed: $(tail -3 "$WORK/$name.err")"; return
  fi
  if compare "$WORK/$name.ref.jsonl" "$WORK/$name.out.jsonl" "$name encode" ids; then ok "$name encode"; else bad "$name encode"; fi
  python3 -c "
import json, sys
with open(sys.argv[2], 'w') as o:
    for l in open(sys.argv[1]): o.write(json.dumps({'ids': json.loads(l)['ids']}) + '\n')" \
    "$WORK/$name.ref.jsonl" "$WORK/$name.ids.jsonl"
  if "$TALON" tokenize --tokenizer "$tok" --input "$WORK/$name.ids.jsonl" --output "$WORK/$name.dec.jsonl" \
      2>"$WORK/$name.err" && compare "$WORK/$name.ref.jsonl" "$WORK/$name.dec.jsonl" "$name decode" decoded; then
    ok "$name decode"
  else
    bad "$name decode"
  fi
}

# llamacpp NAME TOKENIZER VOCAB: llama.cpp's HF-generated ids for its vocab-test inputs.
llamacpp() {
  local name=$1 tok=$2 base="$TOK/llamacpp_vocab_tests/ggml-vocab-$3.gguf"
  python3 - "$base.inp" "$WORK/$name.lc.jsonl" <<'PY'
import json, sys
texts = open(sys.argv[1], encoding="utf-8").read().split("\n__ggml_vocab_test__\n")[:-1]
with open(sys.argv[2], "w", encoding="utf-8") as o:
    for t in texts: o.write(json.dumps({"text": t, "add_special_tokens": False}, ensure_ascii=False) + "\n")
PY
  "$TALON" tokenize --tokenizer "$tok" --input "$WORK/$name.lc.jsonl" --output "$WORK/$name.lc.out" 2>"$WORK/$name.err" \
    || { bad "$name llama.cpp pairs: talon failed: $(tail -3 "$WORK/$name.err")"; return; }
  python3 - "$base.out" "$WORK/$name.lc.out" "$name" <<'PY' && ok "$name llama.cpp pairs ($3)" || bad "$name llama.cpp pairs ($3)"
import json, sys
got = [json.loads(l) for l in open(sys.argv[2], encoding="utf-8")]
exp = [[int(x) for x in l.split()] for l in open(sys.argv[1], encoding="utf-8").read().split("\n")[:len(got)]]
eq = sum(g["ids"] == e for g, e in zip(got, exp))
for g, e in zip(got, exp):
    if g["ids"] != e: print(f"  mismatch: {g['text']!r}: llama.cpp {e} talon {g['ids']}")
print(f"{sys.argv[3]} llama.cpp pairs: {len(got)} texts, {eq} equal")
sys.exit(0 if eq == len(got) == len(exp) else 1)
PY
}

for f in gpt2 qwen2 llama3; do
  mkdir -p "$WORK/hf-$f" && gunzip -c "$TOK/hf/$f/tokenizer.json.gz" >"$WORK/hf-$f/tokenizer.json"
done
family gpt2 "$WORK/hf-gpt2/tokenizer.json"
llamacpp gpt2 "$WORK/hf-gpt2/tokenizer.json" gpt-2
family qwen2 "$WORK/hf-qwen2/tokenizer.json"
llamacpp qwen2 "$WORK/hf-qwen2/tokenizer.json" qwen2
family llama3 "$WORK/hf-llama3/tokenizer.json"
llamacpp llama3 "$WORK/hf-llama3/tokenizer.json" llama-bpe
# Meta's tiktoken tokenizer.model for Llama-3; reference = the HF llama3 tokenizer.json plus Meta's
# 256 special tokens and "<|begin_of_text|> $A" (as meta-llama/Meta-Llama-3-8B's tokenizer.json).
mkdir -p "$WORK/llama3-tiktoken-ref"
if python3 "$SRC/tools/make_tiktoken_fixtures.py" --reference-json "$WORK/hf-llama3/tokenizer.json" \
    "$WORK/llama3-tiktoken-ref/tokenizer.json" 2>"$WORK/llama3-tiktoken-ref.err"; then
  REF_TOK="$WORK/llama3-tiktoken-ref/tokenizer.json" family llama3-tiktoken "$TOK/files/llama3_tiktoken/tokenizer.model"
  llamacpp llama3-tiktoken "$TOK/files/llama3_tiktoken/tokenizer.model" llama-bpe
else
  bad "llama3-tiktoken: reference failed: $(tail -3 "$WORK/llama3-tiktoken-ref.err")"
fi
family gpt-neox "$TOK/files/gpt-neox-20b/tokenizer.json"

GGUF="$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ -f "$GGUF" ]; then
  family smollm2-gguf "$GGUF" --export-json "$WORK/smollm2.tokenizer.json"
  family smollm2-json "$WORK/smollm2.tokenizer.json"
else
  bad "smollm2: $GGUF missing (scripts/setup.sh fetches it)"
fi

# SentencePiece models: oracle = the sentencepiece package (score-based BPE), plus llama.cpp pairs.
family llama2-spm "$TOK/files/llama2_spm/tokenizer.model" --sentencepiece
llamacpp llama2-spm "$TOK/files/llama2_spm/tokenizer.model" llama-spm
family mistral-v1-spm "$TOK/files/mistral_spm/tokenizer.model.v1" --sentencepiece
family mistral-v3-spm "$TOK/files/mistral_spm/mistral_instruct_tokenizer_240323.model.v3" --sentencepiece
# transformers 5's own conversion of the Llama-2 model (Metaspace prepend_scheme=first) as a tokenizer.json.
mkdir -p "$WORK/llama2-hf" && cp "$TOK/files/llama2_spm/tokenizer.model" "$WORK/llama2-hf/tokenizer.model"
python3 -c "
import sys; sys.path.insert(0, '$SRC/tools'); import tokenizer_reference as r
r.load_hf('$WORK/llama2-hf/tokenizer.model').save('$WORK/llama2-hf/tokenizer.json')" 2>/dev/null
family llama2-transformers5-json "$WORK/llama2-hf/tokenizer.json"
finish
