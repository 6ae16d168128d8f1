#!/usr/bin/env bash
# The draft-training peer (bench/train_peer.py) against the fp64 oracle: its TTT loss and
# every weight gradient with the explicit-mask attention, and the flex-attention forward,
# must match tools/eagle3_oracle.py before any of its timings mean anything.
source "$(dirname "$0")/lib.sh"
python3 -c "import torch" 2>/dev/null || { echo "PyTorch missing (scripts/setup.sh installs it)"; exit 1; }
if python3 "$SRC/bench/train_peer.py" --check-only > "$WORK/check.log" 2>&1; then
  grep "^check" "$WORK/check.log"
  ok "the peer matches the oracle"
else
  cat "$WORK/check.log"
  bad "the peer disagrees with the oracle"
fi
finish
