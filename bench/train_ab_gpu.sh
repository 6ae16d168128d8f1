#!/usr/bin/env bash
# One engine flag of the GPU draft trainer, A/B in one call: first the GPU trainer's tests (the
# flag's own tests among them), then talon_bench_train without and with FLAG, alternating
# ROUNDS times at each sequence length, at the loss share of the training sets, then a table.
# Both arms run the same binary on the same machine, one after the other.
#   source scripts/gpu_carried.sh
#   FLAG=--gpu-fused-products [SEQS="2048 4096"] [ROUNDS=2] [SHAPE=llama3-8b] [LOSS_SHARE=0.675] \
#     [TESTS='*GpuDraft*:CudaKernels.Swiglu*:CudaKernels.Casts*'] [ARGS="--steps 12"] \
#     bash bench/train_ab_gpu.sh
# ARGS go to both arms (FLAG may hold several words too). ENV_ON: environment settings of the
# "with" arm only (e.g. ENV_ON="TALON_CUDA_PDL=103"); with ENV_ON, FLAG may be empty:
#   FLAG= ENV_ON="TALON_CUDA_PDL=103" TESTS=0 bash bench/train_ab_gpu.sh
# TESTS=0 skips the tests. Logs go to $OUT/train_ab (the device machine) or a temporary folder.
set -uo pipefail
cd "$(dirname "$0")/.."
ENV_ON=${ENV_ON:-}
FLAG=${FLAG-}
if [ -z "$FLAG" ] && [ -z "$ENV_ON" ]; then
  echo "FLAG (a talon_bench_train flag, e.g. --gpu-fused-products) or ENV_ON (e.g. TALON_CUDA_PDL=103) is needed" >&2
  exit 2
fi
read -r -a envs_on <<< "$ENV_ON"
SEQS=${SEQS:-"2048 4096"}
ROUNDS=${ROUNDS:-2}
SHAPE=${SHAPE:-llama3-8b}
LOSS_SHARE=${LOSS_SHARE:-0.675}
TESTS=${TESTS:-'*GpuDraft*:CudaKernels.Swiglu*:CudaKernels.Casts*'}
ARGS=${ARGS:-}
log=${OUT:+$OUT/train_ab}
log=${log:-$(mktemp -d)}
mkdir -p "$log"
echo "== $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
if [ "$TESTS" != 0 ]; then
  echo "== tests: $TESTS"
  build/tests/talon_tests --gtest_filter="$TESTS" > "$log/tests.txt" 2>&1
  echo "exit $?"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran" "$log/tests.txt" | sort -u
fi
tps() { sed -n 's/.*: \([0-9]*\) tokens\/s.*/\1/p' "$1" | tail -1; }
mem() { sed -n 's/.*device memory \([0-9.]*\) GiB.*/\1/p' "$1" | tail -1; }
rows=()
for seq in $SEQS; do
  a=() b=()
  for r in $(seq "$ROUNDS"); do
    for arm in off on; do
      read -r -a flags <<< "$ARGS"
      if [ "$arm" = on ]; then read -r -a more <<< "$FLAG"; flags+=("${more[@]}"); fi
      f="$log/$arm-$seq-$r"
      envs=()
      if [ "$arm" = on ]; then envs=("${envs_on[@]}"); fi
      env "${envs[@]}" build/talon_bench_train --shape "$SHAPE" --seq "$seq" --samples 1 --loss-share "$LOSS_SHARE" "${flags[@]}" \
        > "$f" 2>&1 || tail -3 "$f"
      if [ "$arm" = on ]; then b+=("$(tps "$f")"); else a+=("$(tps "$f")"); fi
    done
  done
  rows+=("$seq|${a[*]}|${b[*]}|$(mem "$log/off-$seq-1") / $(mem "$log/on-$seq-1")")
done
echo
echo "| seq x 1 | without ${FLAG:+$FLAG }${ENV_ON} tok/s | with it tok/s | change (mean) | memory GiB (without / with) |"
echo "|---|---|---|---|---|"
for r in "${rows[@]}"; do
  IFS='|' read -r seq a b m <<< "$r"
  ch=$(python3 -c "import sys; a=[float(x) for x in sys.argv[1].split()]; b=[float(x) for x in sys.argv[2].split()]
print(f'{(sum(b)/len(b))/(sum(a)/len(a))*100-100:+.1f}%' if a and b else '-')" "$a" "$b" 2>/dev/null || echo -)
  echo "| $seq | ${a// / \/ } | ${b// / \/ } | $ch | $m |"
done
