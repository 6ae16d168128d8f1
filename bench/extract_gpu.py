#!/usr/bin/env python3
"""GPU extraction benchmark: talon extract --device cuda vs HF transformers bf16 + sdpa
with output_hidden_states (the EAGLE/SpecForge HF-backend way), same model files, same
samples, one run, one GPU. Prints talon, peer (best batch size), the bf16 GEMM ceiling
and each side's % of roofline. Checks features agree before timing.

  python3 bench/extract_gpu.py --model DIR|FILE.gguf [--samples 256 --min-len 128 --max-len 2048]
      [--lengths bench/data/sharegpt_1k.smollm2.lengths] [--dp-devices 0,1]

--lengths takes sample lengths from a file (one per line; the committed one holds the
token counts of ../shared/data/train/sharegpt_1k prepared with SmolLM2's chat template).
Peak GPU memory is sampled with nvidia-smi while each side runs.
"""
import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch


class PeakMemory:
    """Samples nvidia-smi's memory.used (MiB) on the given GPUs every 50 ms."""

    def __init__(self, gpus):
        import threading
        self.gpus, self.peak, self.stop = gpus, {g: 0 for g in gpus}, threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self):
        q = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits"]
        while not self.stop.is_set():
            try:
                for line in subprocess.run(q, capture_output=True, text=True).stdout.splitlines():
                    i, m = (int(x) for x in line.split(","))
                    if i in self.peak:
                        self.peak[i] = max(self.peak[i], m)
            except Exception:
                pass
            self.stop.wait(0.05)

    def __enter__(self):
        self.t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


def make_data(path, n, lo, hi, vocab, seed=0, lengths=None):
    r = random.Random(seed)
    lens = []
    with open(path, "w") as f:
        for i in range(n):
            t = r.randint(lo, hi) if lengths is None else min(hi, lengths[i % len(lengths)])
            ids = [r.randrange(vocab) for _ in range(t)]
            f.write(json.dumps({"id": i, "input_ids": ids, "loss_mask": [1] * t}) + "\n")
            lens.append(t)
    return lens


def run_talon(a, data, out, extra=(), device="cuda:0"):
    shutil.rmtree(out, ignore_errors=True)
    cmd = [a.talon, "extract", "--model", a.model, "--data", data, "--out", out, "--device", device,
           "--max-batch-tokens", str(a.max_batch_tokens), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"talon failed ({p.returncode}): {p.stderr[-3000:]}")
    tok, secs = re.search(r"extract: (\d+) tokens in ([\d.]+)s", p.stderr).groups()
    load = float(re.search(r"loaded in ([\d.]+)s", p.stderr).group(1))
    return int(tok), float(secs), load, p.stderr


def load_peer(model_path):
    from transformers import AutoModelForCausalLM
    t = time.perf_counter()
    if model_path.endswith(".gguf"):
        d, f = os.path.split(os.path.abspath(model_path))
        m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(torch.bfloat16)
    else:
        m = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    m = m.cuda().eval()
    torch.cuda.synchronize()
    return m, time.perf_counter() - t


def peer_extract(model, samples, layers, bs, keep=False):
    last = model.model.layers[-1]
    pre = []
    hook = last.register_forward_hook(lambda mod, i, o: pre.append(o[0] if isinstance(o, tuple) else o))
    order = sorted(range(len(samples)), key=lambda i: len(samples[i]))
    out = {}
    with torch.inference_mode():
        for s in range(0, len(order), bs):
            idx = order[s:s + bs]
            T = max(len(samples[i]) for i in idx)
            ids = torch.zeros(len(idx), T, dtype=torch.long)
            att = torch.zeros(len(idx), T, dtype=torch.long)
            for r, i in enumerate(idx):
                ids[r, :len(samples[i])] = torch.tensor(samples[i])
                att[r, :len(samples[i])] = 1
            pre.clear()
            o = model.model(input_ids=ids.cuda(), attention_mask=att.cuda(), output_hidden_states=True)
            aux = torch.cat([o.hidden_states[k] for k in layers], dim=-1).cpu()
            fin = pre[0].cpu()
            if keep:
                for r, i in enumerate(idx):
                    n = len(samples[i])
                    out[i] = (aux[r, :n].float().numpy(), fin[r, :n].float().numpy())
    torch.cuda.synchronize()
    hook.remove()
    return out


def ceiling():
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); a @ b; e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return 2 * n**3 / statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--talon", default="build/talon")
    ap.add_argument("--model", required=True)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=128)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--max-batch-tokens", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--peer-batches", default="1,4,16")
    ap.add_argument("--lengths", help="file of sample lengths, one per line")
    ap.add_argument("--dp-devices", help="also run talon data parallel on these GPUs, e.g. 0,1")
    ap.add_argument("--tp-devices", help="also run talon tensor parallel over these GPUs, e.g. 0,1")
    ap.add_argument("--tmp", help="directory for the data and talon's output (default: the system temp dir)")
    ap.add_argument("--talon-only", action="store_true", help="skip transformers (and the correctness check)")
    a = ap.parse_args()
    file_lengths = [int(x) for x in open(a.lengths).read().split()] if a.lengths else None
    tmp = tempfile.mkdtemp(prefix="talon-gbench-", dir=a.tmp)
    if a.talon_only:
        peer, peer_load = None, 0.0
        cfg = json.load(open(os.path.join(a.model, "config.json")))
        V, L, H = cfg["vocab_size"], cfg["num_hidden_layers"], cfg["hidden_size"]
        I = cfg["intermediate_size"]
        nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        hd = cfg.get("head_dim") or H // nh
        n_mm = L * (H * (nh + 2 * nkv) * hd + nh * hd * H + 3 * H * I)
    else:
        peer, peer_load = load_peer(a.model)
        cfg = peer.config
        V, L, H = cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size
        n_mm = sum(p.numel() for n, p in peer.named_parameters() if p.dim() == 2 and "embed" not in n and "lm_head" not in n)
    data = os.path.join(tmp, "data.jsonl")
    lens = make_data(data, a.samples, a.min_len, a.max_len, V, lengths=file_lengths)
    samples = [json.loads(l)["input_ids"] for l in open(data)]
    n_tok = sum(lens)

    out = os.path.join(tmp, "feat")
    # Correctness on the first 8 samples: talon (fp32 features) vs the peer (bf16).
    layers = None
    if not a.talon_only:
        small = os.path.join(tmp, "small.jsonl")
        with open(data) as f, open(small, "w") as g:
            for _ in range(8):
                g.write(f.readline())
        out = os.path.join(tmp, "feat")
        run_talon(a, small, out, ["--fp32"])
        man = json.load(open(os.path.join(out, "manifest.json")))
        layers = man["aux_layer_ids"]
        from safetensors.numpy import load_file
        parts = [load_file(os.path.join(out, s["file"])) for s in man["shards"]]
        t = {k: np.concatenate([p[k] for p in parts]) for k in ("aux_hidden_states", "hidden_states")}
        off = np.concatenate([[0], np.cumsum([len(p["input_ids"]) for p in parts])])
        off = np.concatenate([o + p["sample_offsets"][1:] for o, p in zip(off, parts)])
        off = np.concatenate([[0], off])
        ref = peer_extract(peer, samples[:8], layers, 1, keep=True)
        worst = 0.0
        for j in range(8):
            for x, y in ((t["aux_hidden_states"][off[j]:off[j + 1]], ref[j][0]), (t["hidden_states"][off[j]:off[j + 1]], ref[j][1])):
                err = np.abs(x - y).max(axis=1) / np.maximum(1, np.abs(y).max(axis=1))
                worst = max(worst, float(np.median(err)))
        print(f"correctness: median per-row relative difference talon vs transformers bf16 = {worst:.2e}")

    talon_ts, loads = [], []
    base_mib = PeakMemory([0])
    with base_mib:
        time.sleep(0.2)
    with PeakMemory([0]) as talon_mem:
        for _ in range(a.repeats):
            tok, secs, load, log = run_talon(a, data, out)
            talon_ts.append(secs)
            loads.append(load)
    tp_ts = []
    if a.tp_devices:
        for _ in range(a.repeats):
            tok, secs, _, _ = run_talon(a, data, out, ["--tp", str(len(a.tp_devices.split(",")))],
                                        device="cuda:" + a.tp_devices)
            tp_ts.append(secs)
    dp_ts, dp_n = [], 0
    if a.dp_devices:
        dp_n = len(a.dp_devices.split(","))
        for _ in range(a.repeats):
            tok, secs, _, dp_log = run_talon(a, data, out, device="cuda:" + a.dp_devices)
            dp_ts.append(secs)
    peer_t = {}
    torch.cuda.reset_peak_memory_stats()
    with PeakMemory([0]) as peer_mem:
        for bs in ([] if a.talon_only else map(int, a.peer_batches.split(","))):
            try:
                peer_extract(peer, samples[: max(bs, 8)], layers, bs)
                ts = []
                for _ in range(a.repeats):
                    t0 = time.perf_counter()
                    peer_extract(peer, samples, layers, bs)
                    ts.append(time.perf_counter() - t0)
                peer_t[bs] = statistics.median(ts)
            except torch.cuda.OutOfMemoryError:
                print(f"peer batch {bs}: out of memory")
                torch.cuda.empty_cache()
    best = min(peer_t, key=peer_t.get) if peer_t else None
    ceil = ceiling()
    T_avg = n_tok / len(samples)
    flops = (2 * n_mm + 4 * L * T_avg * H) * n_tok
    roof = flops / ceil
    tt = statistics.median(talon_ts)
    print()
    src = f"lengths from {a.lengths}" if a.lengths else f"uniform {a.min_len}-{a.max_len}"
    print(f"model {a.model}: L={L} H={H} V={V}, {len(samples)} samples, {n_tok} tokens "
          f"(mean {T_avg:.0f}, {src}, max {a.max_len}), "
          f"median of {a.repeats}, {torch.cuda.get_device_name()}")
    print("| what | tokens/s | seconds | % of roofline |")
    print("|---|---|---|---|")
    print(f"| talon extract --device cuda:0 (bf16 features written to disk) | {n_tok / tt:,.0f} | {tt:.3f} | {100 * roof / tt:.1f}% |")
    if tp_ts:
        t2 = statistics.median(tp_ts)
        print(f"| talon extract --device cuda:{a.tp_devices} --tp {len(a.tp_devices.split(','))} | {n_tok / t2:,.0f} | "
              f"{t2:.3f} | {100 * roof / t2 / len(a.tp_devices.split(',')):.1f}% per GPU |")
    if dp_ts:
        dt = statistics.median(dp_ts)
        print(f"| talon extract --device cuda:{a.dp_devices} (data parallel x{dp_n}) | {n_tok / dt:,.0f} | {dt:.3f} | "
              f"{100 * roof / dt / dp_n:.1f}% per GPU; {tt / dt:.2f}x one GPU |")
    for bs, s in sorted(peer_t.items()):
        print(f"| transformers bf16 sdpa, batch {bs}{' (best)' if bs == best else ''}, features to host | {n_tok / s:,.0f} | {s:.3f} | {100 * roof / s:.1f}% |")
    print(f"| ceiling: cuBLAS bf16 8192^3 | {ceil / 1e12:.0f} TFLOP/s | roofline {roof:.3f} | 100% |")
    if best is not None:
        print(f"talon / peer(best) = {peer_t[best] / tt:.2f}x; model load: talon {statistics.median(loads):.2f}s, "
              f"transformers {peer_load:.2f}s")
    else:
        print(f"model load: talon {statistics.median(loads):.2f}s")
    def account(lg):
        return " | ".join(l.split("] ", 1)[-1] for l in lg.splitlines()
                          if "forward " in l or "writers:" in l or "batches:" in l)
    print("talon's own account (last one-GPU run): " + account(log))
    if dp_ts:
        print("talon's own account (last data-parallel run): " + account(dp_log))
    b0 = base_mib.peak[0]
    print(f"peak GPU memory used (nvidia-smi, above the {b0} MiB held before): talon {talon_mem.peak[0] - b0} MiB "
          f"(--max-batch-tokens {a.max_batch_tokens}); transformers {peer_mem.peak[0] - b0} MiB "
          f"(torch max reserved {torch.cuda.max_memory_reserved() >> 20} MiB)")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
