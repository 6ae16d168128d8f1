#!/usr/bin/env python3
"""Per-kernel table of a Chrome trace written by `talon_bench_decode --trace FILE` (CUPTI
activity of replayed graphs, so neighbours overlap as they do in real steps): launches, mean
and total microseconds per kernel name, sorted by total. With --per N the totals are also
divided by N (e.g. the steps traced)."""
import argparse
import json
import re
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--per", type=float, default=1.0, help="divide totals by this (steps in the trace)")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    agg = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("pid") != "device" or "bytes" in e.get("args", {}):
            continue  # host calls and copies
        name = re.sub(r"\(.*", "", e["name"])
        name = re.sub(r"^void ", "", name)
        agg[name][0] += 1
        agg[name][1] += float(e["dur"])
    rows = sorted(agg.items(), key=lambda kv: -kv[1][1])
    total = sum(v[1] for v in agg.values())
    print(f"{'kernel':<70} {'n':>6} {'mean us':>9} {'us/' + str(a.per):>10}")
    for name, (n, t) in rows[: a.top]:
        print(f"{name[:70]:<70} {n:>6} {t / n:>9.2f} {t / a.per:>10.1f}")
    print(f"{'all kernels':<70} {sum(v[0] for v in agg.values()):>6} {'':>9} {total / a.per:>10.1f}")


if __name__ == "__main__":
    main()
