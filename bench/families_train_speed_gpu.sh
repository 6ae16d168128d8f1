#!/usr/bin/env bash
# P-EAGLE and DFlash draft training on one GPU, in one run: the GPU parity tests of both
# trainers, then per sequence length Talon (`talon_bench_train --drafter peagle|dflash`) and
# speculators 0.9.0's own model classes driven as its trainer drives them
# (bench/train_peer_families.py), on the same shape, loss-masked share and family settings
# (P-EAGLE: 7 depths, COD 0.7 / 0.2; DFlash: 5 layers, blocks of 16, up to 512 anchors, CE with
# D-PACE), then a table of tokens/s, memory and ratios. Logs stay under $LOGS if set.
#   bash scripts/gpu_build.sh && [SPECULATORS_WHEEL=path.whl] [LOSS_SHARE=f] \
#     bash bench/families_train_speed_gpu.sh [SHAPE] ["SEQS"]
# e.g. SPECULATORS_WHEEL=.gpucarry/speculators-0.9.0-py3-none-any.whl bash bench/families_train_speed_gpu.sh smollm2
set -uo pipefail
cd "$(dirname "$0")/.."
SHAPE=${1:-smollm2}
SEQS=${2:-"2048 4096"}
LOSS_SHARE=${LOSS_SHARE:-0.675}
[ -f build/env.sh ] && source build/env.sh
if ! python3 -c "import speculators.models.dflash" 2>/dev/null; then
  [ -n "${SPECULATORS_WHEEL:-}" ] || { echo "speculators is not installed: set SPECULATORS_WHEEL" >&2; exit 2; }
  python3 -m pip install --quiet --no-deps "$SPECULATORS_WHEEL" ||
    python3 -m pip install --quiet --no-deps --break-system-packages "$SPECULATORS_WHEEL" || exit 2
fi
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1); commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
echo "== GPU parity tests of the P-EAGLE and DFlash trainers"
build/tests/talon_tests --gtest_filter='*PEagle*:*GpuDFlash*' 2>&1 | grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests? ran" |
  sort -u
log=${LOGS:-$(mktemp -d)}
mkdir -p "$log"
rows=()
pick() { v=$(sed -n "$1" "$2" 2>/dev/null | tail -1); echo "${v:--}"; }
for seq in $SEQS; do
  for d in peagle dflash; do
    if [ $d = peagle ]; then
      talon_args=(--ttt 7)
      peer_args=(--depths 7)
    else
      talon_args=(--draft-layers 5 --block-size 16 --max-anchors 512 --dflash-loss ce --dflash-weighting dpace)
      peer_args=(--layers 5 --block 16 --max-anchors 512 --dflash-loss ce --dflash-weighting dpace)
    fi
    echo "== $d, seq $seq, loss share $LOSS_SHARE"
    build/talon_bench_train --drafter $d --shape "$SHAPE" --seq "$seq" --samples 1 --steps 8 \
      --loss-share "$LOSS_SHARE" "${talon_args[@]}" > "$log/talon-$d-$seq" 2>&1
    tail -1 "$log/talon-$d-$seq"
    python3 bench/train_peer_families.py --drafter $d --shape "$SHAPE" --seq "$seq" --steps 8 \
      --loss-share "$LOSS_SHARE" "${peer_args[@]}" > "$log/peer-$d-$seq" 2>&1
    tail -1 "$log/peer-$d-$seq"
    t=$(pick 's/.*: \([0-9]*\) tokens\/s.*/\1/p' "$log/talon-$d-$seq")
    tm=$(pick 's/.*device memory \([0-9.]*\) GiB.*/\1/p' "$log/talon-$d-$seq")
    p=$(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(round(r['tokens_per_s']))" "$log/peer-$d-$seq" 2>/dev/null || echo -)
    pm=$(python3 -c "import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print(f\"{r['peak_allocated_gib']:.1f}\")" "$log/peer-$d-$seq" 2>/dev/null || echo -)
    rows+=("$d $seq $t $p $tm $pm")
  done
done
echo
echo "| drafter | seq | Talon tok/s | speculators tok/s | Talon / speculators | memory GiB (Talon / speculators allocated) |"
echo "|---|---|---|---|---|---|"
ratio() { python3 -c "import sys; a, b = sys.argv[1:]; print(f'{float(a) / float(b):.2f}x' if a != '-' and b not in ('-', '0') else '-')" "$1" "$2"; }
for r in "${rows[@]}"; do
  set -- $r
  echo "| $1 | $2 | $3 | $4 | $(ratio "$3" "$4") | $5 / $6 |"
done
[ -z "${LOGS:-}" ] && rm -rf "$log"
