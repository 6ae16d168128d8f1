#!/usr/bin/env bash
# One GPU call for the CUDA cached decoder: build (scripts/gpu_build.sh), the CUDA and decoder
# tests, then talon_bench_decode on the random 8B shape (contexts 2048 and 512) and the
# SmolLM2 shape, plus the real SmolLM2 when TALON_SMOLLM2_GGUF names it. Logs go to $OUT
# (the device tool's output folder) when set, else to build/. Run from the repository root
# after `tar -xzf .gpucarry/deps.tar.gz`.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-build}
bash scripts/gpu_build.sh || exit 1
source build/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
build/tests/talon_tests --gtest_filter='*Cuda*:*Decode*:*RandomCheckpoint*' --gtest_brief=1 > "$log/tests.log" 2>&1
echo "tests rc $?"
grep -vE "^\[ +(RUN|OK) +\]" "$log/tests.log" | grep -v '^$' | tail -40
for args in "--context 2048 --batches 1,32,256" "--context 512 --batches 1,32,256 --tree 0" \
            "--shape smollm2 --context 2048 --batches 1,32,256"; do
  echo "== talon_bench_decode $args"
  build/talon_bench_decode $args 2>&1 | tee -a "$log/bench.log"
done
if [ -n "${TALON_SMOLLM2_GGUF:-}" ] && [ -f "$TALON_SMOLLM2_GGUF" ]; then
  echo "== talon_bench_decode --model $TALON_SMOLLM2_GGUF"
  build/talon_bench_decode --model "$TALON_SMOLLM2_GGUF" --context 2048 --batches 1,32,256 2>&1 | tee -a "$log/bench.log"
fi
