#!/usr/bin/env bash
# One decoder setting from the environment, A/B in one call: first the decoder's GPU tests with
# the setting, then talon_bench_decode without and with it, alternating ROUNDS times, and a
# table of greedy ms a step per slot count. Both arms run the same binary on the same machine.
#   source scripts/gpu_carried.sh
#   ENV=TALON_CUDA_SETTING=value [SHAPE=llama3-8b] [CONTEXT=512] [BATCHES=1,32,256] [ROUNDS=2] \
#     [TESTS='*CudaDecodeAttention*:*CudaDecode*'] bash bench/decode_ab_gpu.sh
# TESTS=0 skips the tests. Logs go to $OUT/decode_ab (the device machine) or a temporary folder.
set -uo pipefail
cd "$(dirname "$0")/.."
ENV=${ENV:?ENV: the setting to compare, e.g. TALON_CUDA_FUSE_ROWS=1}
SHAPE=${SHAPE:-llama3-8b}
CONTEXT=${CONTEXT:-512}
BATCHES=${BATCHES:-1,32,256}
ROUNDS=${ROUNDS:-2}
TESTS=${TESTS:-'*CudaDecodeAttention*:*CudaDecode*'}
log=${OUT:+$OUT/decode_ab}
log=${log:-$(mktemp -d)}
mkdir -p "$log"
read -r -a envs <<< "$ENV"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$TESTS" != 0 ]; then
  echo "== tests with $ENV: $TESTS"
  env "${envs[@]}" build/tests/talon_tests --gtest_filter="$TESTS" > "$log/tests.txt" 2>&1
  echo "exit $?"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran" "$log/tests.txt" | sort -u
fi
for r in $(seq "$ROUNDS"); do
  for arm in off on; do
    e=(); [ "$arm" = on ] && e=("${envs[@]}")
    env "${e[@]}" build/talon_bench_decode --shape "$SHAPE" --context "$CONTEXT" --batches "$BATCHES" --steps 16 \
      --tree 0 --verify-tokens 1 --accept-chain 0 > "$log/$arm-$r" 2>&1 || tail -3 "$log/$arm-$r"
  done
done
echo
echo "| slots x $CONTEXT | without: greedy ms | with $ENV | change (mean) | floor ms |"
echo "|---|---|---|---|---|"
IFS=',' read -r -a bs <<< "$BATCHES"
for b in "${bs[@]}"; do
  # the batch table's row: slots, context, eager, graph, greedy ms (5th), ..., floor ms (8th)
  col() { awk -v b="$b" -v c="$CONTEXT" -v k="$2" '$1 == b && $2 == c && NF >= 12 {print $k; exit}' "$1"; }
  a=() w=()
  for r in $(seq "$ROUNDS"); do a+=("$(col "$log/off-$r" 5)"); w+=("$(col "$log/on-$r" 5)"); done
  ch=$(python3 -c "import sys; a=[float(x) for x in sys.argv[1].split()]; b=[float(x) for x in sys.argv[2].split()]
print(f'{(sum(b)/len(b))/(sum(a)/len(a))*100-100:+.1f}%' if a and b else '-')" "${a[*]}" "${w[*]}" 2>/dev/null || echo -)
  sa="${a[*]}" sw="${w[*]}"
  echo "| $b | ${sa// / \/ } | ${sw// / \/ } | $ch | $(col "$log/off-1" 8) |"
done
