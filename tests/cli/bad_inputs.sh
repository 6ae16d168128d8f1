#!/usr/bin/env bash
# Every bad input: non-zero exit, a one-line error naming the file and the problem,
# and no output directory contents left behind.
source "$(dirname "$0")/lib.sh"
TINY=$SRC/tests/fixtures/golden/llama_tied      # L = 4, V = 113, sharded bf16
tokens 3 113 1 8 > "$WORK/good.jsonl"

# expect NAME PATTERN -- talon args...: exit != 0, stderr matches PATTERN, $WORK/out empty.
expect() {
  local name=$1 pat=$2; shift 3
  rm -rf "$WORK/out"
  "$TALON" "$@" > "$WORK/stdout" 2> "$WORK/stderr"
  local rc=$?
  local msg; msg=$(grep '^error: ' "$WORK/stderr" | head -1)
  if [ $rc -eq 0 ]; then bad "$name: exit 0"; return; fi
  if ! grep -qE -- "$pat" <<< "$msg"; then bad "$name: error '$msg' does not match /$pat/"; return; fi
  if [ -d "$WORK/out" ] && [ -n "$(ls -A "$WORK/out" 2>/dev/null | grep -v '^.talon.lock$')" ]; then
    bad "$name: left files in --out: $(ls -A "$WORK/out")"; return
  fi
  ok "$name: $msg"
}
model_copy() { rm -rf "$WORK/m"; cp -r "$1" "$WORK/m"; }
X=(extract --data "$WORK/good.jsonl" --out "$WORK/out" --layers 1,2,3)

expect missing-model 'nope.*no such file' -- extract --model "$WORK/nope" --data "$WORK/good.jsonl" --out "$WORK/out"
model_copy "$TINY"; rm "$WORK/m/config.json"
expect no-config 'no config.json' -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; echo '{"model_type": "llama", ' > "$WORK/m/config.json"
expect bad-config-json 'config.json: not valid JSON' -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; sed -i 's/"model_type": "llama"/"model_type": "gpt_neox"/; s/LlamaForCausalLM/GPTNeoXForCausalLM/' "$WORK/m/config.json"
expect unknown-arch 'unknown architecture.*gpt_neox' -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; sed -i 's/"intermediate_size": \([0-9]*\)/"intermediate_size": 1\1/' "$WORK/m/config.json"
expect wrong-shape "mlp.gate_proj.weight.*expected shape \[1[0-9]+, 40\], got" -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; f=$(ls "$WORK"/m/model-00002-*.safetensors); truncate -s 1000 "$f"
expect truncated-shard "model-00002.*(runs past end|outside the data section)" -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; f=$(ls "$WORK"/m/model-00001-*.safetensors); printf '\xff\xff\xff\xff\xff\xff\xff\x7f' | dd of="$f" conv=notrunc 2>/dev/null
expect huge-header "model-00001.*header length" -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; f=$(ls "$WORK"/m/model-00003-*.safetensors); printf 'xx' | dd of="$f" bs=1 seek=9 conv=notrunc 2>/dev/null
expect corrupt-header "model-00003.*not valid JSON" -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; rm "$WORK"/m/model-00004-*.safetensors
expect missing-shard "model-00004.*does not exist" -- "${X[@]}" --model "$WORK/m"
model_copy "$TINY"; python3 - "$WORK/m" <<'PY'
import json, sys
p = sys.argv[1] + "/model.safetensors.index.json"; j = json.load(open(p))
j["weight_map"]["model.layers.9.mlp.up_proj.weight"] = list(j["weight_map"].values())[0]
json.dump(j, open(p, "w"))
PY
expect index-lists-absent "model.layers.9.mlp.up_proj.weight" -- "${X[@]}" --model "$WORK/m"

GG=$(ls "$SRC"/tests/fixtures/gguf/*.gguf | head -1)
head -c 100 "$GG" > "$WORK/trunc.gguf"
expect truncated-gguf 'trunc.gguf' -- "${X[@]}" --model "$WORK/trunc.gguf"
{ printf 'GGUX'; tail -c +5 "$GG"; } > "$WORK/magic.gguf"
expect bad-gguf-magic 'magic.gguf' -- "${X[@]}" --model "$WORK/magic.gguf"

M=(extract --model "$TINY" --out "$WORK/out" --layers 1,2,3)
printf '%s\n' '{"input_ids": [1, 2], "loss_mask": [0, 1]}' 'not json' > "$WORK/d1.jsonl"
expect jsonl-not-json 'd1.jsonl:2: not valid JSON' -- "${M[@]}" --data "$WORK/d1.jsonl"
printf '%s\n' '{"input_ids": [1, 2]}' > "$WORK/d2.jsonl"
expect jsonl-no-mask "d2.jsonl:1: missing field 'loss_mask'" -- "${M[@]}" --data "$WORK/d2.jsonl"
printf '%s\n' '{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}' > "$WORK/d3.jsonl"
expect jsonl-length "d3.jsonl:1: 'loss_mask' has 2 entries but 'input_ids' has 3" -- "${M[@]}" --data "$WORK/d3.jsonl"
printf '\n%s\n' '{"input_ids": [1, 500], "loss_mask": [0, 1]}' > "$WORK/d4.jsonl"
expect token-out-of-vocab 'd4.jsonl:2: input_ids\[1\] = 500 outside' -- "${M[@]}" --data "$WORK/d4.jsonl"
printf '%s\n' '{"input_ids": [1, -2], "loss_mask": [0, 1]}' > "$WORK/d5.jsonl"
expect negative-token 'd5.jsonl:1: input_ids\[1\] = -2' -- "${M[@]}" --data "$WORK/d5.jsonl"
printf '%s\n' '{"input_ids": [1, 2], "loss_mask": [0, 2]}' > "$WORK/d6.jsonl"
expect bad-mask 'd6.jsonl:1: loss_mask\[1\] = 2' -- "${M[@]}" --data "$WORK/d6.jsonl"
printf '\xff\xfe{"input_ids": [1]}\n' > "$WORK/d7.jsonl"
expect jsonl-bad-utf8 'd7.jsonl:1' -- "${M[@]}" --data "$WORK/d7.jsonl"
: > "$WORK/d8.jsonl"
expect jsonl-empty 'd8.jsonl: no samples' -- "${M[@]}" --data "$WORK/d8.jsonl"
expect missing-data 'absent.jsonl.*cannot open' -- "${M[@]}" --data "$WORK/absent.jsonl"

D=(extract --model "$TINY" --data "$WORK/good.jsonl" --out "$WORK/out")
expect layers-two "--layers '1,2'.*exactly 3" -- "${D[@]}" --layers 1,2
expect layers-text "--layers 'a,b,c'.*'a' is not an integer" -- "${D[@]}" --layers a,b,c
expect layers-order "--layers '3,1,2'.*strictly increasing" -- "${D[@]}" --layers 3,1,2
expect layers-range "--layers '1,2,9'.*id 9 outside \[0, 4\]" -- "${D[@]}" --layers 1,2,9
expect layers-default-small "default aux layers.*not distinct for L = 4" -- "${D[@]}"
expect device "--device 'tpu': expected cpu, cuda, cuda:N or cuda:N,M" -- "${D[@]}" --layers 1,2,3 --device tpu
expect device-list "--device 'cuda:0,x': expected" -- "${D[@]}" --layers 1,2,3 --device cuda:0,x
expect device-twice "--device 'cuda:1,1': cuda:1 is listed twice" -- "${D[@]}" --layers 1,2,3 --device cuda:1,1
expect tp-on-cpu "--tp/--ep/--dp need --device cuda" -- "${D[@]}" --layers 1,2,3 --tp 2
expect log-level "--log-level 'loud'" -- --log-level loud "${D[@]}" --layers 1,2,3
finish
