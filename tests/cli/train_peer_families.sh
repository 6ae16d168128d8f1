#!/usr/bin/env bash
# The P-EAGLE and DFlash training-speed peer (bench/train_peer_families.py: speculators 0.9.0's
# own model classes, driven as its trainer drives them) runs its tiny CPU case for both
# drafters: a finite, non-zero loss (zero would mean no loss-masked position reached the
# loss, a broken batch) that the optimizer steps move. Timings come from the GPU machine.
source "$(dirname "$0")/lib.sh"
python3 -c "import torch, speculators.models.peagle, speculators.models.dflash" 2>/dev/null ||
  { echo "PyTorch or speculators missing (scripts/setup.sh installs them)"; exit 1; }
for d in peagle dflash; do
  if python3 "$SRC/bench/train_peer_families.py" --drafter $d --tiny > "$WORK/$d.json" 2> "$WORK/$d.err"; then
    if python3 - "$WORK/$d.json" <<'PY'
import json, math, sys
r = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
a, b = r["loss_first"], r["loss_last"]
ok = all(math.isfinite(x) for x in (a, b)) and a > 0 and b > 0 and a != b and r["tokens_per_s"] > 0
print(f"{r['drafter']}: loss {a:.5f} -> {b:.5f}, {r['steps']} timed steps")
sys.exit(0 if ok else 1)
PY
    then ok "$d peer runs"; else bad "$d peer: a zero, non-finite or unmoved loss"; fi
  else
    tail -5 "$WORK/$d.err"
    bad "$d peer failed"
  fi
done
finish
