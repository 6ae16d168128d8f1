#!/usr/bin/env python3
"""Tokenizer throughput: talon vs HF `tokenizers` on the same corpus (every string in
../shared/data/{train,dev}), single-threaded and with N threads, in one run.

    python3 bench/tokenizer_speed.py --talon build/talon --tokenizer PATH/tokenizer.json [--threads N] [--repeat R]

talon's time is the whole `talon tokenize` process (load + JSONL parse + encode + write), so it
is a conservative measure; HF's is encode only (single: encode_batch with RAYON_NUM_THREADS=1 in
a child process; N threads: encode_batch with RAYON_NUM_THREADS=N).
"""
import argparse, glob, json, os, subprocess, sys, tempfile, time

HERE = os.path.dirname(os.path.abspath(__file__))


def corpus(data):
    texts = []
    def walk(v):
        if isinstance(v, str): texts.append(v)
        elif isinstance(v, list):
            for x in v: walk(x)
        elif isinstance(v, dict):
            for x in v.values(): walk(x)
    for root in ("train", "dev"):
        for f in sorted(glob.glob(os.path.join(data, root, "**", "*"), recursive=True)):
            if f.endswith(".jsonl"):
                for l in open(f, encoding="utf-8"):
                    if l.strip(): walk(json.loads(l))
            elif f.endswith(".json"):
                walk(json.load(open(f, encoding="utf-8")))
    return texts


HF_CHILD = r"""
import json, sys, time
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1]); texts = [json.loads(l)["text"] for l in open(sys.argv[2], encoding="utf-8")]
best = 1e9; n = 0
for _ in range(int(sys.argv[3])):
    t = time.perf_counter(); enc = tok.encode_batch(texts); best = min(best, time.perf_counter() - t)
    n = sum(len(e.ids) for e in enc)
print(json.dumps({"s": best, "tokens": n}))
"""


def hf(tokenizer, path, threads, repeat):
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="true")
    out = subprocess.run([sys.executable, "-c", HF_CHILD, tokenizer, path, str(repeat)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def talon(binary, tokenizer, path, threads, repeat):
    best = 1e9
    with tempfile.TemporaryDirectory() as d:
        for _ in range(repeat):
            t = time.perf_counter()
            subprocess.run([binary, "tokenize", "--tokenizer", tokenizer, "--input", path, "--output",
                            os.path.join(d, "o.jsonl"), "--threads", str(threads)], check=True)
            best = min(best, time.perf_counter() - t)
        n = sum(len(json.loads(l)["ids"]) for l in open(os.path.join(d, "o.jsonl"), encoding="utf-8"))
    return {"s": best, "tokens": n}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--talon", default=os.path.join(HERE, "..", "build", "talon"))
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json (HF must load it too)")
    ap.add_argument("--data", default=os.path.join(HERE, "..", "..", "shared", "data"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    texts = corpus(a.data)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False, encoding="utf-8") as f:
        for t in texts: f.write(json.dumps({"text": t}, ensure_ascii=False) + "\n")
        path = f.name
    try:
        rows = []
        for th in sorted({1, a.threads}):
            h = hf(a.tokenizer, path, th, a.repeat)
            t = talon(a.talon, a.tokenizer, path, th, a.repeat)
            if h["tokens"] != t["tokens"]:
                print(f"warning: token counts differ (hf {h['tokens']}, talon {t['tokens']})")
            rows.append((th, h, t))
        mb = sum(len(t.encode()) for t in texts) / 1e6
        print(f"corpus: {len(texts)} texts, {mb:.1f} MB, {rows[0][1]['tokens']} tokens; tokenizer {a.tokenizer}")
        print(f"{'threads':>7} | {'HF tok/s':>12} | {'talon tok/s':>12} | {'talon/HF':>8}")
        for th, h, t in rows:
            hs, ts = h["tokens"] / h["s"], t["tokens"] / t["s"]
            print(f"{th:>7} | {hs:>12,.0f} | {ts:>12,.0f} | {ts / hs:>7.2f}x")
        if len(rows) > 1:
            print(f"talon scaling 1 -> {rows[-1][0]} threads: {rows[0][2]['s'] / rows[-1][2]['s']:.2f}x; "
                  f"HF: {rows[0][1]['s'] / rows[-1][1]['s']:.2f}x")
    finally:
        os.unlink(path)


if __name__ == "__main__":
    main()
