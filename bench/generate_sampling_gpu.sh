#!/usr/bin/env bash
# `talon generate` whole command on the SmolLM2 regeneration job (bench/regen_smollm2_gpu.sh's
# generate stage: T 0.7, top-p 0.95, seed 1, batch 256, up to 1,024 new tokens, --max-len 2048),
# stopped by SIGINT after SECONDS, once with sampling on the device (the default) and once
# with TALON_CUDA_SAMPLE=0 (logits to the host, the host's sampler). Model load included.
# Tokens: the kept conversations' assistant turns, counted afterwards with `talon tokenize`.
#   bench/generate_sampling_gpu.sh GGUF TRAIN_DIR WORK [SECONDS]
set -uo pipefail
cd "$(dirname "$0")/.."
gguf=$1 train=$2 work=$3 secs=${4:-90}
T=${TALON:-build/talon}
mkdir -p "$work"
printf "| sampling | seconds | conversations kept | assistant tokens | tokens/s |\n|---|---:|---:|---:|---:|\n" > "$work/table.md"
for mode in device host; do
  out=$work/gen_$mode
  rm -rf "$out"
  env $([ $mode = host ] && echo TALON_CUDA_SAMPLE=0) timeout --foreground -s INT "$secs" $T generate --model "$gguf" \
    --data "$train/sharegpt_1k" "$train/ultrachat_eval" "$train/mt_bench_101" "$train/self_instruct" "$train/gsm8k" \
    --out "$out" --device cuda:0 --batch 256 --max-new-tokens 1024 --max-len 2048 --temperature 0.7 --top-p 0.95 \
    --seed 1 > "$work/gen_$mode.log" 2>&1
  tail -2 "$work/gen_$mode.log"
  python3 - "$out/progress.jsonl" "$work/text_$mode.jsonl" <<'PY'
import json, sys
n = 0
with open(sys.argv[2], "w") as f:
    for line in open(sys.argv[1]):
        line = line.strip()
        if not line:
            continue
        j = json.loads(line)
        if j.get("skipped"):
            continue
        n += 1
        for m in j["messages"]:
            if m["role"] == "assistant":
                f.write(json.dumps({"text": m["content"]}) + "\n")
print(n, file=open(sys.argv[2] + ".n", "w"))
PY
  $T tokenize --tokenizer "$gguf" --input "$work/text_$mode.jsonl" --out "$work/ids_$mode.jsonl" > /dev/null 2>&1
  toks=$(python3 -c "import json,sys; print(sum(len(json.loads(l)['ids']) for l in open(sys.argv[1]) if l.strip()))" "$work/ids_$mode.jsonl")
  convs=$(cat "$work/text_$mode.jsonl.n")
  printf "| %s | %d | %d | %d | %.0f |\n" $mode "$secs" "$convs" "$toks" "$(python3 -c "print($toks / $secs)")" >> "$work/table.md"
done
cat "$work/table.md"
