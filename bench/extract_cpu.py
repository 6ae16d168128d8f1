#!/usr/bin/env python3
"""CPU extraction benchmark: talon extract vs HF transformers fp32 (the peer), same weights
(SmolLM2-135M-Instruct GGUF, dequantised), same samples, same thread count, one run.

Prints a table: tokens/s of talon and of the peer at its best batch size, the ratio, the
CPU fp32 GEMM ceiling (torch matmul) and each side's % of the roofline. Checks the
hidden states of both sides agree before timing.

  python3 bench/extract_cpu.py [--talon build/talon] [--gguf PATH] [--data FILE] [--repeats 5] [--threads 2]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch


def talon_run(talon, gguf, data, out, threads, fp32=True):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [talon, "extract", "--model", gguf, "--data", data, "--out", out, "--threads", str(threads)]
    if fp32:
        cmd.append("--fp32")
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"talon failed: {p.stderr}")
    m = re.search(r"extract: (\d+) tokens in ([\d.]+)s", p.stderr)
    return int(m.group(1)), float(m.group(2))


def load_peer(gguf):
    from transformers import AutoModelForCausalLM
    d, f = os.path.split(os.path.abspath(gguf))
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def peer_extract(model, samples, layers, L, bs):
    """Forward in padded batches of `bs` (sorted by length), copy aux + h[L] to host."""
    captured = {}
    last = model.model.layers[-1]
    pre_norm = []
    hook = last.register_forward_hook(lambda m, i, o: pre_norm.append(o[0] if isinstance(o, tuple) else o))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    tokens = 0
    with torch.inference_mode():
        for s in range(0, len(order), bs):
            idx = order[s:s + bs]
            T = max(len(samples[i]) for i in idx)
            ids = torch.zeros(len(idx), T, dtype=torch.long)
            att = torch.zeros(len(idx), T, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(samples[i])] = torch.tensor(samples[i])
                att[r, :len(samples[i])] = 1
            pre_norm.clear()
            out = model.model(input_ids=ids, attention_mask=att, output_hidden_states=True)
            hs = out.hidden_states
            for r, i in enumerate(idx):
                n = len(samples[i])
                aux = torch.cat([hs[k][r, :n] for k in layers], dim=-1).numpy().copy()
                fin = pre_norm[0][r, :n].numpy().copy()
                captured[i] = (aux, fin)
                tokens += n
    hook.remove()
    return captured, tokens


def gemm_ceiling(threads, n=2048, reps=7):
    torch.set_num_threads(threads)
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    for _ in range(2):
        a @ b
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        ts.append(time.perf_counter() - t)
    return 2 * n**3 / statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--talon", default="build/talon")
    ap.add_argument("--gguf", default=".cache/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--data", default="examples/demo_tokens.jsonl")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    samples = [json.loads(l)["input_ids"] for l in open(a.data) if l.strip()]
    tmp = tempfile.mkdtemp(prefix="talon-bench-")
    out = os.path.join(tmp, "feat")

    # Correctness first: talon's fp32 features vs the peer's on every sample.
    talon_run(a.talon, a.gguf, a.data, out, a.threads)
    man = json.load(open(os.path.join(out, "manifest.json")))
    layers, L, H = man["aux_layer_ids"], man["final_layer_id"], man["hidden_size"]
    from safetensors.numpy import load_file
    feats = {}
    for sh in man["shards"]:
        t = load_file(os.path.join(out, sh["file"]))
        off = t["sample_offsets"]
        for j, gi in enumerate(t["sample_index"]):
            feats[int(gi)] = (t["aux_hidden_states"][off[j]:off[j + 1]], t["hidden_states"][off[j]:off[j + 1]])
    model = load_peer(a.gguf)
    ref, _ = peer_extract(model, samples, layers, L, bs=1)
    worst = 0.0
    for i, (aux, fin) in ref.items():
        for x, y in ((feats[i][0], aux), (feats[i][1], fin)):
            # relative to the largest magnitude per token row (SmolLM2 has huge outlier channels)
            err = np.abs(x - y).max(axis=1) / np.maximum(1, np.abs(y).max(axis=1))
            worst = max(worst, float(err.max()))
    print(f"correctness: max per-row relative error talon vs transformers = {worst:.2e}")
    if worst > 1e-3:
        sys.exit("talon and transformers disagree; not timing")

    # Timing: median of repeats, each side warm.
    n_tok = sum(len(s) for s in samples)
    talon_ts = []
    for _ in range(a.repeats):
        tok, secs = talon_run(a.talon, a.gguf, a.data, out, a.threads, fp32=False)
        talon_ts.append(secs)
    peer = {}
    for bs in (1, 4, 8):
        ts = []
        peer_extract(model, samples, layers, L, bs)  # warm-up
        for _ in range(a.repeats):
            t = time.perf_counter()
            peer_extract(model, samples, layers, L, bs)
            ts.append(time.perf_counter() - t)
        peer[bs] = statistics.median(ts)
    best_bs = min(peer, key=peer.get)
    ceiling = gemm_ceiling(a.threads)
    cfg = model.config
    n_matmul = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    if cfg.tie_word_embeddings:
        n_matmul -= cfg.vocab_size * cfg.hidden_size  # extraction does not run the lm_head
    T_avg = n_tok / len(samples)
    flops_per_tok = 2 * n_matmul + 4 * cfg.num_hidden_layers * T_avg * cfg.hidden_size
    roof_s = flops_per_tok * n_tok / ceiling
    t_talon = statistics.median(talon_ts)
    t_peer = peer[best_bs]
    print()
    print(f"| what | tokens/s | seconds | % of roofline |")
    print(f"|---|---|---|---|")
    print(f"| talon extract (cpu, bf16 out, incl. shard write) | {n_tok / t_talon:.0f} | {t_talon:.3f} | {100 * roof_s / t_talon:.1f}% |")
    for bs, t in sorted(peer.items()):
        print(f"| transformers fp32 sdpa, batch {bs}{' (best)' if bs == best_bs else ''} | {n_tok / t:.0f} | {t:.3f} | {100 * roof_s / t:.1f}% |")
    print(f"| ceiling: torch fp32 GEMM 2048^3 | {ceiling / 1e9:.1f} GFLOP/s | roofline {roof_s:.3f} s | 100% |")
    print()
    print(f"talon / peer(best) = {t_peer / t_talon:.2f}x on {n_tok} tokens, {len(samples)} samples, "
          f"{a.threads} threads, median of {a.repeats}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
