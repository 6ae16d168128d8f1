#!/usr/bin/env bash
# Draft training on one GPU, in one run: the GPU parity tests of the trainer, the bf16 GEMM
# ceiling, Talon (`talon_bench_train`: features in pinned memory as `talon train` keeps them,
# then the VARIANT run) and the PyTorch peer (bench/train_peer.py, which first checks itself
# against the oracle), then a table of tokens/s, memory and ratios. Every log is kept under
# $LOGS (default: $OUT/train_compare on the device machine, else a temporary folder).
#   bash scripts/gpu_build.sh && [LOSS_SHARE=f] [VARIANT=staged|resident|cudnn|flash|device|allrows|fused|zeroed|loaddiag|headgroups|rope|cublas|base|none] \
#     bash bench/train_compare_gpu.sh [SHAPE] ["SEQS"] [SAMPLES] [PEER_COMPILE]
# e.g. LOSS_SHARE=0.675 VARIANT=resident bash bench/train_compare_gpu.sh llama3-8b "2048 4096" 1 full
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE=${1:-llama3-8b}
SEQS=${2:-"2048 4096"}
SAMPLES=${3:-1}
PEER_COMPILE=${4:-full}
# Share of loss-masked (answer) tokens in the benchmark batches, for both sides: 1 is the
# most work for Talon, which only makes draft logits for rows whose loss counts (the peer's
# work does not depend on it).
LOSS_SHARE=${LOSS_SHARE:-1}
[ -f build/env.sh ] && source build/env.sh
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

if [ "${TESTS:-1}" != 0 ]; then  # TESTS=0: the caller ran them
  echo "== GPU parity tests of the trainer"
  build/tests/talon_tests --gtest_filter='*GpuDraft*:*CudnnSdpa*' 2>&1 | grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran" | sort -u
fi

echo "== bf16 GEMM ceiling (8192^3, median of 10)"
CEIL=$(python3 - <<'PY'
import torch, statistics
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3): a @ b
ts = []
for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); a @ b; e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
print(f"{2 * 8192**3 / statistics.median(ts) / 1e12:.0f}")
PY
)
echo "ceiling: ${CEIL} TFLOP/s"

rows=()
# Each helper prints "-" when its log lacks the figure (a run skipped or failed), so that the
# table's columns stay in place.
pick() { v=$(sed -n "$1" "$2" 2>/dev/null | tail -1); echo "${v:--}"; }
tps() { pick 's/.*: \([0-9]*\) tokens\/s.*/\1/p' "$1"; }
mem_talon() { pick 's/.*device memory \([0-9.]*\) GiB.*/\1/p' "$1"; }
mem_peer() { pick 's/.*peak memory \([0-9.]*\) GiB.*/\1/p' "$1"; }
res_peer() { pick 's/.*(reserved \([0-9.]*\) GiB).*/\1/p' "$1"; }
# VARIANT: the second Talon run: staged (features in pageable memory, through the pinned
# staging), resident (features in device memory, as the peer keeps them), cudnn (the TTT
# attention's causal part through cuDNN's fused attention: --gpu-attention cudnn), device (the
# whole target embedding on the device, as before per-batch rows were the default:
# --gpu-device-embeddings), allrows (every row through every step: --gpu-all-rows; the default
# leaves out of the steps after the first the rows no later loss reads), fused (gate|up and q|k|v
# backward as one product each: --gpu-fused-products), zeroed (the whole gradient memset before
# a step: --gpu-zeroed-grads; the default writes each matrix's first product), loaddiag (the
# diagonal keys' kernels a load at a time, as before their rows went into registers:
# --gpu-no-diag-registers), headgroups (cuDNN's backward in head groups where its workspace
# would not fit the lent memory: --gpu-cudnn-head-groups), rope (RoPE, row moves and casts of
# q, k, v and their gradients in one kernel each, and the forward's q|k|v as one product:
# --gpu-fused-rope), flash (the fused kernels
# for every batch: --gpu-attention flash; the default, auto, takes cuDNN for the batches whose
# workspace fits the memory lent to it), cublas (--gpu-products cublas: every product's
# algorithm cuBLAS's own choice; the default, auto, takes the fastest cuBLASLt candidate with
# the first one's bits, timed in untimed steps before the timed ones), base (the same flags
# through another build's talon_bench_train, named by BASE_BIN: a change against the code
# before it, in one call), or none.
VARIANT=${VARIANT:-staged}
vbin=build/talon_bench_train
case "$VARIANT" in
  staged | resident) vflag=("--$VARIANT") ;;
  cudnn | flash) vflag=(--gpu-attention "$VARIANT") ;;
  device) vflag=(--gpu-device-embeddings) ;;
  allrows) vflag=(--gpu-all-rows) ;;
  fused) vflag=(--gpu-fused-products) ;;
  zeroed) vflag=(--gpu-zeroed-grads) ;;
  loaddiag) vflag=(--gpu-no-diag-registers) ;;
  headgroups) vflag=(--gpu-cudnn-head-groups) ;;
  rope) vflag=(--gpu-fused-rope) ;;
  cublas) vflag=(--gpu-products cublas) ;;
  base)
    vflag=()
    vbin=${BASE_BIN:?VARIANT=base needs BASE_BIN, another build of talon_bench_train}
    ;;
  none) vflag=() ;;
  *) echo "VARIANT=$VARIANT: expected staged, resident, cudnn, flash, device, allrows, fused, zeroed, loaddiag, headgroups, rope, cublas, base or none" >&2; exit 2 ;;
esac
# On the device machine ($OUT set) the logs default to $OUT/train_compare, so that they come back
# even when the command's printed output is longer than what the call returns.
[ -z "${LOGS:-}" ] && [ -n "${OUT:-}" ] && LOGS=$OUT/train_compare
log=${LOGS:-$(mktemp -d)}
mkdir -p "$log"
for seq in $SEQS; do
  echo "== seq $seq x $SAMPLES samples, loss share $LOSS_SHARE"
  build/talon_bench_train --shape "$SHAPE" --seq "$seq" --samples "$SAMPLES" --steps 7 --peak-tflops "$CEIL" \
    --loss-share "$LOSS_SHARE" > "$log/talon-$seq" 2>&1
  grep "^loss-masked" "$log/talon-$seq"
  tail -1 "$log/talon-$seq"
  if [ "$VARIANT" != none ]; then
    "$vbin" --shape "$SHAPE" --seq "$seq" --samples "$SAMPLES" --steps 7 --peak-tflops "$CEIL" \
      --loss-share "$LOSS_SHARE" "${vflag[@]}" > "$log/$VARIANT-$seq" 2>&1
    tail -1 "$log/$VARIANT-$seq"
  fi
  python3 bench/train_peer.py --shape "$SHAPE" --seq "$seq" --samples "$SAMPLES" --steps 8 --compile "$PEER_COMPILE" \
    --peak-tflops "$CEIL" --loss-share "$LOSS_SHARE" > "$log/peer-$seq" 2>&1
  grep -E "^check|^peer" "$log/peer-$seq" || tail -5 "$log/peer-$seq"
  rows+=("$seq $(tps "$log/talon-$seq") $(tps "$log/$VARIANT-$seq") $(tps "$log/peer-$seq") $(mem_talon "$log/talon-$seq") $(mem_talon "$log/$VARIANT-$seq") $(mem_peer "$log/peer-$seq") $(res_peer "$log/peer-$seq")")
done

echo
echo "| seq x samples | Talon tok/s | Talon, $VARIANT | peer tok/s | Talon / peer ($VARIANT / peer) | memory GiB (Talon / $VARIANT / peer allocated / peer reserved) |"
echo "|---|---|---|---|---|---|"
ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a) / float(b):.2f}x' if a != '-' and b not in ('-', '0') else '-')" "$1" "$2"; }
for r in "${rows[@]}"; do
  set -- $r
  echo "| $1 x $SAMPLES | $2 | $3 | $4 | $(ratio "$2" "$4") ($(ratio "$3" "$4")) | $5 / $6 / $7 / $8 |"
done
if [ -z "${LOGS:-}" ]; then rm -rf "$log"; fi
