#!/usr/bin/env bash
# One GPU call for the CUDA cached decoder: build (scripts/gpu_build.sh), the CUDA and decoder
# tests, then talon_bench_decode on the random 8B shape (contexts 2048 and 512) and the
# SmolLM2 shape, batch 1 again with each decode switch off (the paged KV cache too, and at
# batch 256 against the flat layout), plus the real SmolLM2 when
# TALON_SMOLLM2_GGUF names it. Logs go to $OUT
# (the device tool's output folder) when set, else to build/. Run from the repository root
# after `tar -xzf .gpucarry/deps.tgz` (made here by scripts/pack_deps.sh, then
# `tar czf .gpucarry/deps.tgz .deps`; carry it with the call).
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
# QUICK=1: the tests and the short-verify table only (no batch tables, no switch sweep).
quick=${QUICK:-0}
[ "$quick" = 1 ] || for args in "--context 2048 --batches 1,32,256" "--context 512 --batches 1,32,256 --tree 0" \
            "--shape smollm2 --context 2048 --batches 1,32,256"; do
  echo "== talon_bench_decode $args"
  build/talon_bench_decode $args 2>&1 | tee -a "$log/bench.log"
done
# Batch 1 with each switch of the decode path off in turn (docs/reference.md), so that what each
# one buys is measured in the same call: verify tiles, lone rows in tiles, folded one-token
# layers, dependent launches.
[ "$quick" = 1 ] || for sw in TALON_CUDA_VERIFY_TILES TALON_CUDA_LONE_TILES TALON_CUDA_FUSE TALON_CUDA_PDL TALON_CUDA_KV_PAGED; do
  for shape in "--context 2048" "--shape smollm2 --context 512 --draft-vocab 8192"; do
    echo "== $sw=0 talon_bench_decode $shape --batches 1"
    env "$sw=0" build/talon_bench_decode $shape --batches 1 2>&1 | tee -a "$log/bench.log" |
      grep -E "^ +1 |chain   4|tree   32|round"
  done
done
# The paged KV cache against the flat layout it replaced (TALON_CUDA_KV_PAGED=0: same memory
# layout, no page table) where attention reads the most keys: batch 256.
[ "$quick" = 1 ] || for sw in TALON_CUDA_KV_PAGED=1 TALON_CUDA_KV_PAGED=0; do
  for ctx in 512 2048; do
    echo "== $sw talon_bench_decode --context $ctx --batches 256 --tree 0"
    env $sw build/talon_bench_decode --context $ctx --batches 256 --tree 0 2>&1 | tee -a "$log/bench.log" | grep -E "^ +256 "
  done
done
# Products and folding of short verifies (2-8 rows) on the small shape: skinny products up to
# n rows (TALON_CUDA_GEMV_ROWS), folded layers up to n rows (TALON_CUDA_FUSE_ROWS).
for sw in "TALON_CUDA_FUSE_ROWS=1" "TALON_CUDA_FUSE_ROWS=2" "TALON_CUDA_FUSE_ROWS=4" "TALON_CUDA_FUSE_ROWS=8" \
          "TALON_CUDA_GEMV_ROWS=8 TALON_CUDA_FUSE_ROWS=1" "TALON_CUDA_GEMV_ROWS=8 TALON_CUDA_FUSE_ROWS=8"; do
  echo "== $sw talon_bench_decode --shape smollm2 --context 512 --batches 1 --draft-vocab 8192"
  env $sw build/talon_bench_decode --shape smollm2 --context 512 --batches 1 --draft-vocab 8192 2>&1 |
    tee -a "$log/bench.log" | grep -E "chain   [1248] |chain-3 |tree d6"
done
if [ -n "${TALON_SMOLLM2_GGUF:-}" ] && [ -f "$TALON_SMOLLM2_GGUF" ]; then
  echo "== talon_bench_decode --model $TALON_SMOLLM2_GGUF"
  build/talon_bench_decode --model "$TALON_SMOLLM2_GGUF" --context 2048 --batches 1,32,256 2>&1 | tee -a "$log/bench.log"
fi
