#!/usr/bin/env python3
"""Per-kernel time table: launches, mean and total microseconds per kernel name and grid,
sorted by total. With --per N, totals are also divided by N (e.g. the number of forwards).
Two inputs:
* an Nsight Compute CSV (ncu --csv --page raw --metrics gpu__time_duration.sum). Kernels are
  timed one at a time under ncu (no overlap between neighbours), so the sum is an upper bound
  of a graph replay's GPU time;
* a Chrome trace (a .json file) written by `talon_bench_decode --trace FILE` or
  `talon_bench_train --trace FILE`: CUPTI activity of the real run (replayed graphs included),
  so neighbours overlap as they do there (a programmatic dependent's time includes its wait).
  Names are demangled with c++filt where it is installed; the grid is not recorded ("-").
  With --gaps (traces only), the device's idle time instead: each gap between the end of the
  work before (kernels and copies, overlaps merged) and the next start, by the name of the work
  that ends it, by whether that is a library kernel (cuBLAS, cuDNN, CUTLASS) or one of ours,
  and by size (launch gaps are a few us; the host's waits are longer)."""
import argparse
import csv
import json
import re
import shutil
import subprocess
import sys
from collections import defaultdict


def demangle(names):
    """C++ names as c++filt prints them, where it is installed; else as they are."""
    if not names or not shutil.which("c++filt"):
        return {n: n for n in names}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {n: (out[i] if i < len(out) and out[i] else n) for i, n in enumerate(names)}


def short(name):
    """A kernel's name without its namespaces and parameter list, keeping template arguments."""
    name = re.sub(r"^void ", "", name)
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    name = re.sub(r"\b(talon::)?(cuda::)?", "", name)
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the parameter list: the first '(' outside template brackets
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            cut = i
            break
    return name[:cut]


def ncu_rows(path):
    """(name, grid, us) of each launch in an ncu CSV."""
    rows = []
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"')]  # ncu prints its own messages before the table
    for r in csv.DictReader(lines):
        v = r.get("gpu__time_duration.sum", "")
        try:
            t = float(v.replace(",", ""))
        except ValueError:
            continue  # the units row
        name = re.sub(r"\(.*", "", r.get("Kernel Name", "?"))
        name = re.sub(r"^void ", "", name)
        rows.append((name[:70], r.get("Grid Size", "?"), t / 1e3))  # ns -> us
    return rows


def trace_rows(path):
    """(name, "-", us) of each kernel in a Chrome trace (host calls and copies left out)."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("pid") == "device" and "bytes" not in e.get("args", {})]
    names = demangle(sorted({e["name"] for e in kernels}))
    return [(short(names[e["name"]])[:70], "-", float(e["dur"])) for e in kernels]


LIBRARY = re.compile(r"nvjet|cudnn|cutlass|cublas|sm90_xmma|gemm|gemv2|splitK", re.I)


def trace_gaps(path, top):
    """Print the device's idle gaps of a Chrome trace, by the work that ends each one."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("pid") == "device" and "dur" in e]
    if not events:
        sys.exit(f"{path}: no device events")
    names = demangle(sorted({e["name"] for e in events if "bytes" not in e.get("args", {})}))
    events.sort(key=lambda e: float(e["ts"]))
    end = float(events[0]["ts"]) + float(events[0]["dur"])
    by_name = defaultdict(lambda: [0, 0.0])
    by_kind = defaultdict(lambda: [0, 0.0])
    sizes = [(1, "< 1 us"), (3, "1-3 us"), (10, "3-10 us"), (100, "10-100 us"), (float("inf"), ">= 100 us")]
    by_size = defaultdict(lambda: [0, 0.0])
    for e in events[1:]:
        ts, dur = float(e["ts"]), float(e["dur"])
        gap = ts - end
        if gap > 0:
            copy = "bytes" in e.get("args", {})
            name = "(copy or memset) " + e["name"][:50] if copy else short(names[e["name"]])[:70]
            kind = "copies and memsets" if copy else ("library kernels" if LIBRARY.search(name) else "own kernels")
            for agg, key in ((by_name, name), (by_kind, kind), (by_size, next(l for b, l in sizes if gap < b))):
                agg[key][0] += 1
                agg[key][1] += gap
        end = max(end, ts + dur)
    span = end - float(events[0]["ts"])
    idle = sum(v[1] for v in by_kind.values())
    print(f"{len(events)} device events over {span:.1f} us; idle {idle:.1f} us in {sum(v[0] for v in by_kind.values())} gaps")
    print(f"{'gap size':20s} {'gaps':>6s} {'idle us':>9s}")
    for _, label in sizes:
        n, us = by_size.get(label, (0, 0.0))
        print(f"{label:20s} {n:6d} {us:9.1f}")
    print(f"{'ended by':20s} {'gaps':>6s} {'idle us':>9s} {'mean us':>8s}")
    for kind, (n, us) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
        print(f"{kind:20s} {n:6d} {us:9.1f} {us / n:8.2f}")
    print(f"{'ended by':70s} {'gaps':>6s} {'idle us':>9s} {'mean us':>8s}")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"{name:70s} {n:6d} {us:9.1f} {us / n:8.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", help="an ncu CSV, or a Chrome trace (.json)")
    ap.add_argument("--per", type=float, default=1.0, help="divide totals by this (forwards or steps in the file)")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--gaps", action="store_true", help="the device's idle gaps instead (Chrome traces only)")
    a = ap.parse_args()
    if a.gaps:
        if not a.file.endswith(".json"):
            sys.exit(f"{a.file}: --gaps needs a Chrome trace (.json)")
        trace_gaps(a.file, a.top)
        return
    rows = trace_rows(a.file) if a.file.endswith(".json") else ncu_rows(a.file)
    if not rows:
        sys.exit(f"{a.file}: no kernel times")
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
