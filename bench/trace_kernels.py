#!/usr/bin/env python3
"""Per-kernel table of a Chrome trace written by `talon_bench_decode --trace FILE` (CUPTI
activity of replayed graphs, so neighbours overlap as they do in real steps): launches, mean
and total microseconds per kernel name, sorted by total. With --per N the totals are also
divided by N (e.g. the steps traced)."""
import argparse
import json
import re
import shutil
import subprocess
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


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("trace")
    ap.add_argument("--per", type=float, default=1.0, help="divide totals by this (steps in the trace)")
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args()
    with open(a.trace) as f:
        events = json.load(f)["traceEvents"]
    kernels = [e for e in events if e.get("pid") == "device" and "bytes" not in e.get("args", {})]  # no copies
    names = demangle(sorted({e["name"] for e in kernels}))
    agg = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        name = short(names[e["name"]])
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
