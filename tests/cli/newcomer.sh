#!/usr/bin/env bash
# What a new user runs into at the stage boundaries: a mistyped command or option gets a
# suggestion; values are checked before any work starts and a refused start leaves nothing
# behind; handing a stage the previous-but-one stage's output names the missing step; a GPU
# asked for on a machine without one is a plain message; SpecForge's chat layout is read.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
demo_features "$WORK" || bad "prepare + extract of the demo chats"

# refused NAME PATTERN DIR -- talon args...: exit != 0 within seconds, stderr's first error
# line matches PATTERN, no source paths or raw CUDA codes in it, and DIR does not exist after.
refused() {
  local name=$1 pat=$2 dir=$3; shift 4
  rm -rf "$dir"
  local t0=$SECONDS
  "$TALON" "$@" > "$WORK/stdout" 2> "$WORK/stderr"
  local rc=$? took=$((SECONDS - t0))
  local msg; msg=$(grep -m1 '^error: ' "$WORK/stderr")
  if [ $rc -eq 0 ]; then bad "$name: exit 0"; return; fi
  if ! grep -qE -- "$pat" <<< "$msg"; then bad "$name: '$msg' (all: $(head -3 "$WORK/stderr")) does not match /$pat/"; return; fi
  if grep -qE '\.(cpp|cu|h):[0-9]+|error [0-9]+' <<< "$msg"; then bad "$name: internal detail in '$msg'"; return; fi
  if [ -e "$dir" ]; then bad "$name: left $dir behind: $(ls -A "$dir")"; return; fi
  [ $took -le 20 ] || { bad "$name: refused only after $took s"; return; }
  ok "$name: $msg"
}
T=(train --data "$WORK/feat" --model "$GGUF" --max-steps 1 --max-length 32 --draft-vocab 64)

refused typo-command "unknown command 'trian' \(did you mean 'train'\?\)" "$WORK/none" -- trian
refused learning-rate "unexpected argument '--learning-rate' \(did you mean --lr\?\)" "$WORK/o1" -- \
  "${T[@]}" --learning-rate 1e-4 --out "$WORK/o1"
refused typo-option "unexpected argument '--ttt-step' \(did you mean --ttt-steps\?\)" "$WORK/o2" -- \
  "${T[@]}" --ttt-step 3 --out "$WORK/o2"
refused negative-lr "--lr: expected a positive number, got -1" "$WORK/o3" -- "${T[@]}" --lr -1 --out "$WORK/o3"
refused schedule-typo "--schedule.*cosin" "$WORK/o4" -- "${T[@]}" --schedule cosin --out "$WORK/o4"
refused out-inside-data "--out .* is inside --data" "$WORK/feat/run" -- "${T[@]}" --out "$WORK/feat/run"
[ -f "$WORK/feat/manifest.json" ] && ok "the features directory is untouched" || bad "features directory damaged"
refused train-on-tokens "expected \"talon.features\" \(this is .talon prepare. output: run .talon extract" "$WORK/o5" -- \
  train --data "$WORK/tok" --model "$GGUF" --out "$WORK/o5"
refused extract-on-chats "missing field 'input_ids' \(this looks like chat data: tokenize it first with .talon prepare" \
  "$WORK/o6" -- extract --model "$GGUF" --data "$SRC/examples/demo_chats.jsonl" --out "$WORK/o6"

# Inputs talon does not read are named with the conversion; a hub id gets the download hint.
# CSV and TSV are read (libcsv): the same records written by Python's csv module (JSON cells
# for the conversation column, as pandas writes them) tokenize exactly as their JSON Lines.
python3 - "$SRC/examples/demo_chats.jsonl" "$WORK" <<'PY'
import csv, json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][:4]
recs += [{"instruction": "Name a prime, with a comma, \"quotes\"\nand a new line.", "output": "  Seven.\t"}]
with open(f"{sys.argv[2]}/same.jsonl", "w") as f:
    for r in recs: f.write(json.dumps(r) + "\n")
for name, delim in (("same.csv", ","), ("same.tsv", "\t")):
    cols = sorted({k for r in recs for k in r})
    with open(f"{sys.argv[2]}/{name}", "w", newline="") as f:
        w = csv.writer(f, delimiter=delim)
        w.writerow(cols)
        for r in recs:
            w.writerow([json.dumps(r[c]) if isinstance(r.get(c), (list, dict)) else r.get(c, "") for c in cols])
PY
for f in same.jsonl same.csv same.tsv; do
  "$TALON" prepare --model "$GGUF" --data "$WORK/$f" --out "$WORK/p-$f" > /dev/null 2> "$WORK/p.err" \
    || bad "prepare $f: $(tail -3 "$WORK/p.err")"
done
python3 - "$WORK" <<'PY' && ok "CSV and TSV tokenize exactly as the same records in JSON Lines" || bad "CSV/TSV tokens differ"
import json, sys
def rows(f):
    return [(r["input_ids"], r["loss_mask"]) for r in map(json.loads, open(f"{sys.argv[1]}/p-{f}/tokens.jsonl"))]
a = rows("same.jsonl")
assert len(a) == 5, len(a)
assert rows("same.csv") == a and rows("same.tsv") == a
PY
printf 'instruction,output\n"Hi,there\n' > "$WORK/broken.csv"
refused csv-quote "broken.csv: malformed CSV after row 1 \(libcsv: .*an unclosed quote\?\)" "$WORK/o9" -- prepare --model "$GGUF" --data "$WORK/broken.csv" --out "$WORK/o9"
printf 'instruction,output\nHi,there,extra\n' > "$WORK/ragged.csv"
refused csv-ragged "ragged.csv: row 2 has 3 fields, the header row has 2" "$WORK/o9" -- \
  prepare --model "$GGUF" --data "$WORK/ragged.csv" --out "$WORK/o9"
printf 'PAR1\0\0\0\0' > "$WORK/chats.bin"
refused parquet "chats.bin: Parquet files are not read.*pd.read_parquet" "$WORK/o10" -- \
  prepare --model "$GGUF" --data "$WORK/chats.bin" --out "$WORK/o10"
mkdir -p "$WORK/hfds/data" && printf 'PAR1' > "$WORK/hfds/data/train-00000-of-00001.parquet"
refused hf-dataset-dir "hfds: holds .*train-00000-of-00001.parquet \(a Hugging Face dataset\).*load_dataset\('parquet'" \
  "$WORK/o14" -- prepare --model "$GGUF" --data "$WORK/hfds" --out "$WORK/o14"
printf 'PK\003\004rest' > "$WORK/hidden.pt"
refused torch-file "hidden.pt: a PyTorch \(torch.save\) or zip file.*run talon prepare" "$WORK/o15" -- \
  prepare --model "$GGUF" --data "$WORK/hidden.pt" --out "$WORK/o15"
refused hub-id "no such file or directory \(a Hugging Face model id\? .*huggingface-cli download meta-llama/Llama-3.1-8B" \
  "$WORK/o11" -- prepare --model meta-llama/Llama-3.1-8B --data "$SRC/examples/demo_chats.jsonl" --out "$WORK/o11"

# Export names the model the engine serves: --verifier is required, and a GGUF is not one.
refused no-verifier "--verifier is required \(the target as vLLM or SGLang will serve it: its Hugging Face id" \
  "$WORK/o12" -- export --run "$WORK/nowhere" --model "$GGUF" --format speculators --out "$WORK/o12"
refused gguf-verifier "--verifier .*\.gguf is a GGUF file; vLLM and SGLang serve the target from its Hugging Face id" \
  "$WORK/o13" -- export --run "$WORK/nowhere" --model "$GGUF" --verifier "$GGUF" --format speculators --out "$WORK/o13"

# One vocabulary: --max-length and --threads on generate and eval, --out on template.
"$TALON" generate --model "$GGUF" --data "$SRC/examples/demo_chats.jsonl" --limit 1 --max-new-tokens 4 --max-length 256 \
  --threads 1 --out "$WORK/g" > /dev/null 2> "$WORK/g.err" && ok "generate takes --max-length and --threads" \
  || bad "generate: $(tail -3 "$WORK/g.err")"

# A GPU asked for where there is none: a plain message, nothing written (only without a GPU).
if ! "$TALON" gpus 2>/dev/null | grep -q "^cuda:"; then
  refused generate-no-gpu "no CUDA device|no CUDA backend" "$WORK/o7" -- \
    generate --model "$GGUF" --data "$SRC/examples/demo_chats.jsonl" --device cuda --out "$WORK/o7"
  "$TALON" generate --model "$GGUF" --data "$SRC/examples/demo_chats.jsonl" --limit 1 --max-new-tokens 4 \
    --out "$WORK/o7" > /dev/null 2> "$WORK/o7.err" && ok "the CPU retry in the same --out runs" \
    || bad "CPU retry: $(tail -3 "$WORK/o7.err")"
  refused eval-no-gpu "no CUDA device|no CUDA backend" "$WORK/o8" -- \
    eval --model "$GGUF" --draft "$WORK/none" --data "$SRC/examples/demo_questions.jsonl" --device cuda --out "$WORK/o8"
fi

# SpecForge's layout: "conversations" of {role, content} turns reads like OpenAI messages.
printf '%s\n' '{"id": "sf1", "conversations": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}' \
  > "$WORK/sf.jsonl"
printf '%s\n' '{"id": "sf1", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}' \
  > "$WORK/oa.jsonl"
"$TALON" prepare --model "$GGUF" --data "$WORK/sf.jsonl" --out "$WORK/sf" > /dev/null 2> "$WORK/sf.err" \
  && "$TALON" prepare --model "$GGUF" --data "$WORK/oa.jsonl" --out "$WORK/oa" > /dev/null 2>&1 \
  && python3 -c "
import json, sys
a, b = ([(r['input_ids'], r['loss_mask']) for r in map(json.loads, open(p))] for p in sys.argv[1:])
assert a == b and len(a) == 1 and sum(a[0][1]) > 0
" "$WORK/sf/tokens.jsonl" "$WORK/oa/tokens.jsonl" \
  && ok "SpecForge's conversations of {role, content} give the same tokens as messages" \
  || bad "SpecForge layout: $(tail -3 "$WORK/sf.err")"
finish
