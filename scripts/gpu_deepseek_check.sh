#!/usr/bin/env bash
# One GPU call for the DeepSeek / Kimi-K2 family: build (scripts/gpu_build.sh), the CUDA MoE,
# golden, CPU-parity and extract tests, then one Kimi-K2 MoE layer (talon_bench_moe) and a
# Kimi-K2-shaped model of LAYERS layers (talon_bench_deepseek, default 4). Logs go to $OUT
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
build/tests/talon_tests --gtest_filter='*CudaMoe*:*CudaGolden*:*CudaModel*:*DeepseekExtract*:*RandomCheckpoint*' \
  > "$log/deepseek_tests.log" 2>&1
echo "tests rc $?"
grep -E "cuda golden|cuda moe|FAILED|PASSED|SKIPPED|Failure|Expected|Which" "$log/deepseek_tests.log" | tail -40
echo "== talon_bench_moe"
build/talon_bench_moe 2>&1 | tee "$log/bench_moe.log"
echo "== talon_bench_deepseek --layers $layers"
build/talon_bench_deepseek --layers "$layers" 2>&1 | grep -v "^\[" | tee "$log/bench_deepseek.log"
