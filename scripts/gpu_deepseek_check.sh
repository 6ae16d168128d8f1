#!/usr/bin/env bash
# One GPU call for the DeepSeek / Kimi-K2 family: build (scripts/gpu_build.sh), the CUDA MoE,
# golden, CPU-parity, extract and decoder tests, then one Kimi-K2 MoE layer (talon_bench_moe), a
# Kimi-K2-shaped model of LAYERS layers (talon_bench_deepseek, default 4) and its decode steps
# on one GPU and as a --tp 2 group sharing it (talon_bench_decode). Logs go to $OUT
# (the device tool's output folder) when set, else to build/. Run from the repository root
# after `tar -xzf .gpucarry/deps.tar.gz`.
set -uo pipefail
cd "$(dirname "$0")/.."
log=${OUT:-build}
layers=${1:-4}
bash scripts/gpu_build.sh || exit 1
source build/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git log -1 --format='commit %h %s' 2>/dev/null || true
build/tests/talon_tests --gtest_filter='*CudaMoe*:*CudaGolden*:*CudaModel*:*DeepseekExtract*:*RandomCheckpoint*:*DeepSeek*:*TensorParallel*' \
  > "$log/deepseek_tests.log" 2>&1
echo "tests rc $?"
grep -E "cuda golden|cuda moe|FAILED|PASSED|SKIPPED|Failure|Expected|Which" "$log/deepseek_tests.log" | tail -40
echo "== talon_bench_moe"
build/talon_bench_moe 2>&1 | tee "$log/bench_moe.log"
echo "== talon_bench_deepseek --layers $layers"
build/talon_bench_deepseek --layers "$layers" 2>&1 | grep -v "^\[" | tee "$log/bench_deepseek.log"
# Decoding: one GPU, then the tensor-parallel group (two ranks sharing this GPU: the code path
# and its eager-step cost; real --tp needs several GPUs: --tp N without --share-gpus).
for args in "" "--tp 2 --share-gpus" "--ep 2 --share-gpus"; do
  echo "== talon_bench_decode --model random:kimi-k2:$layers --context 2048 --batches 1,8 --tree 0 $args"
  build/talon_bench_decode --model "random:kimi-k2:$layers" --context 2048 --batches 1,8 --tree 0 $args 2>&1 |
    grep -v "^\[" | tee -a "$log/bench_decode_kimi.log"
done
