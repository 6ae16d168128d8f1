#!/usr/bin/env python3
"""Per-kernel time table from an Nsight Compute CSV (ncu --csv --page raw --metrics
gpu__time_duration.sum): launches, mean and total microseconds per kernel name and grid,
sorted by total. With --per N, totals are also divided by N (e.g. the number of forwards).
Kernels are timed one at a time under ncu (no overlap between neighbours), so the sum is an
upper bound of a graph replay's GPU time."""
import argparse
import csv
import re
import sys
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--per", type=float, default=1.0, help="divide totals by this (forwards in the trace)")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    rows = []
    with open(a.csv, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own messages before the table
    reader = csv.DictReader(lines)
    for r in reader:
        v = r.get("gpu__time_duration.sum", "")
        try:
            t = float(v.replace(",", ""))
        except ValueError:
            continue  # the units row
        name = re.sub(r"\(.*", "", r.get("Kernel Name", "?"))
        name = re.sub(r"^void ", "", name)
        rows.append((name[:70], r.get("Grid Size", "?"), t / 1e3))  # ns -> us
    if not rows:
        sys.exit(f"{a.csv}: no gpu__time_duration.sum rows")
    agg = defaultdict(lambda: [0, 0.0])
    for name, grid, us in rows:
        agg[(name, grid)][0] += 1
        agg[(name, grid)][1] += us
    total = sum(v[1] for v in agg.values())
    print(f"{len(rows)} launches, {total:.1f} us in all, {total / a.per:.1f} us per {a.per:g}")
    print(f"{'kernel':70s} {'grid':>16s} {'launches':>8s} {'mean us':>8s} {'total/per':>10s}")
    for (name, grid), (n, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{name:70s} {grid:>16s} {n:8d} {us / n:8.2f} {us / a.per:10.1f}")


if __name__ == "__main__":
    main()
