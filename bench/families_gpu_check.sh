#!/usr/bin/env bash
# The drafter families' GPU checks in one call on one GPU machine:
# 1. the GPU trainers' tests (EAGLE-3, P-EAGLE, DFlash) and the decoder and draft-runner tests;
# 2. `talon train` on the CPU against the GPU for eagle3, peagle and dflash, with stop + resume
#    (bench/train_cli_gpu_check.sh);
# 3. training speed of P-EAGLE and DFlash against speculators 0.9.0
#    (bench/families_train_speed_gpu.sh, SmolLM2 shape), unless SPEED=0;
# 4. unless DECODE=0: decode steps with the paged KV cache against the flat layout
#    (TALON_CUDA_KV_PAGED=0), 8B shape at batch 256, and Kimi-K2 decode steps on one GPU and as
#    --tp 2 / --ep 2 groups sharing it (talon_bench_decode; build it too).
# The tests of step 1 include the paged cache (CudaDecodeAttention, CudaDecode.SlotsShare*) and
# the parallel DeepSeek decoders (CudaDecode.ParallelDeepSeekGroupsMatchTheCpu).
# Three logs go to $LOGS (default: a temporary folder; few files, so that a device call's $OUT
# can bring them back); work files stay under /tmp. A summary goes to stdout.
#   tar xzf .gpucarry/deps.tgz && TARGETS="talon talon_tests talon_bench_train talon_bench_decode" bash scripts/gpu_build.sh &&
#   SPECULATORS_WHEEL=.gpucarry/speculators-0.9.0-py3-none-any.whl LOGS=$OUT bash bench/families_gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
[ -f build/env.sh ] && source build/env.sh
LOGS=${LOGS:-$(mktemp -d)}
mkdir -p "$LOGS"
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
filter='*GpuDraft*:*PEagle*:*GpuDFlash*:*Cuda*:*Decode*:*RandomCheckpoint*:*DraftRunner*:*Speculat*:*Deepseek*:*DeepSeek*'
echo "== tests: $filter"
build/tests/talon_tests --gtest_filter="$filter" --gtest_brief=1 > "$LOGS/tests.log" 2>&1
grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[==========\]" "$LOGS/tests.log" | tail -4
grep -E "^\[  FAILED  \]" "$LOGS/tests.log" | sort -u | head -40
echo "== talon train: CPU against GPU"
WORK=/tmp/talon-gpucli bash bench/train_cli_gpu_check.sh build/talon > "$LOGS/cli.log" 2>&1
tail -12 "$LOGS/cli.log"
if [ "${SPEED:-1}" != 0 ]; then
  echo "== training speed against speculators"
  LOGS=/tmp/talon-speed bash bench/families_train_speed_gpu.sh smollm2 "${SEQS:-2048 4096}" > "$LOGS/speed.log" 2>&1
  tail -12 "$LOGS/speed.log"
fi
if [ "${DECODE:-1}" != 0 ] && [ -x build/talon_bench_decode ]; then
  echo "== decode: paged KV cache against the flat layout (8B shape, batch 256)"
  for sw in TALON_CUDA_KV_PAGED=1 TALON_CUDA_KV_PAGED=0; do
    for ctx in 512 2048; do
      echo "-- $sw context $ctx"
      env $sw build/talon_bench_decode --context $ctx --batches 1,256 --tree 0 --verify-tokens 1 2>&1 |
        tee -a "$LOGS/decode.log" | grep -E "^ +(1|256) "
    done
  done
  echo "== decode: Kimi-K2 shape (2 layers), one GPU and two ranks sharing it"
  for args in "" "--tp 2 --share-gpus" "--ep 2 --share-gpus"; do
    echo "-- $args"
    build/talon_bench_decode --model random:kimi-k2:2 --context 2048 --batches 1,8 --tree 0 --verify-tokens 1 \
      $args 2>&1 | tee -a "$LOGS/decode.log" | grep -E "^ +(1|8) |ms"
  done
fi
