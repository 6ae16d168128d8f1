#!/usr/bin/env python3
"""The draft-training peer: EAGLE-3 training-time test in PyTorch autograd, written from
SPEC-EAGLE3.md sections 2-4 the way the Python trainers do it (fp32 master weights under
bf16 autocast, flex attention with the TTT block mask, fused AdamW, a compiled
target-distribution step). It times full optimizer steps on the same shapes as
`talon_bench_train` (random weights and inputs; speed does not depend on the values) and
prints tokens/s, peak memory and the share of the GEMM ceiling.

Before timing it checks itself against the fp64 test oracle (tools/eagle3_oracle.py) on a
small case: per-step losses and every weight gradient, with both attention paths. On a
machine without a GPU only that check runs (`--check-only` is implied).

  bench/train_peer.py --shape llama3-8b --seq 4096 --samples 1 --steps 8
  bench/train_peer.py --check-only            # the correctness check alone (CPU is fine)
"""
import argparse
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {
    # H, I, heads, kv heads, head_dim, V, rope theta
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256, 500000.0),
    "smollm2": (576, 1536, 9, 3, 64, 49152, 100000.0),
    "kimi-k2": (7168, 18432, 64, 64, 128, 163840, 50000.0),  # the draft talon train makes for Kimi-K2
}
NORMS = ("in_ln", "hidden_norm", "post_ln", "norm")


def wide(x):
    """fp32 for 16-bit tensors; fp64 stays fp64 (the check runs in fp64)."""
    return x if x.dtype == torch.float64 else x.float()


def rms(x, w, eps):
    xf = wide(x)
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_tables(T, K, hd, theta, device):
    """cos/sin [T + K, hd/2] for positions 0 .. T+K-1 (step k uses rows t + k)."""
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    ang = torch.arange(T + K, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


def rope(x, cos, sin):
    """x [B, heads, T, hd]; rotate (i, i + hd/2) pairs (HF rotate_half layout)."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def ttt_mask(T, k, device):
    """Step k's [T, (k+1)T] mask: step-0 keys causally, then each later step's key at the
    query's own row (the diagonal)."""
    q = torch.arange(T, device=device)[:, None]
    kv = torch.arange((k + 1) * T, device=device)[None, :]
    blk, pos = kv // T, kv % T
    return ((blk == 0) & (pos <= q)) | ((blk > 0) & (pos == q))


class FlexTtt:
    """flex_attention with one block mask per step (built once per sequence length)."""

    def __init__(self, T, K, device, compiled):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        self.fn = torch.compile(flex_attention) if compiled else flex_attention
        self.masks = []
        for k in range(K):
            def mask_mod(b, h, q_idx, kv_idx, T=T):
                blk, pos = kv_idx // T, kv_idx % T
                return ((blk == 0) & (pos <= q_idx)) | ((blk > 0) & (pos == q_idx))
            self.masks.append(create_block_mask(mask_mod, None, None, T, (k + 1) * T, device=device))

    def __call__(self, q, keys, vals, k, scale):
        return self.fn(q, keys, vals, block_mask=self.masks[k], scale=scale, enable_gqa=True)


class SdpaTtt:
    def __init__(self, T, K, device):
        self.masks = [ttt_mask(T, k, device) for k in range(K)]

    def __call__(self, q, keys, vals, k, scale):
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=self.masks[k], scale=scale, enable_gqa=True)


def init_weights(c, gen, device, std=0.02):
    H, I, nh, nkv, hd, Vd = c["H"], c["I"], c["nh"], c["nkv"], c["hd"], c["Vd"]
    rn = lambda *s: (torch.randn(*s, generator=gen) * std).to(device)
    W = {"fc": rn(H, 3 * H), "wq": rn(nh * hd, 2 * H), "wk": rn(nkv * hd, 2 * H), "wv": rn(nkv * hd, 2 * H),
         "wo": rn(H, nh * hd), "gate": rn(I, H), "up": rn(I, H), "down": rn(H, I), "lm_head": rn(Vd, H)}
    for n in NORMS:
        W[n] = torch.ones(H, device=device)
    return W


@torch.no_grad()
def target_side(hL, fnorm, tlm, kept, t2d, eps, chunk=1024):
    """P [B, T, Vd] (the target's distribution over the draft vocabulary) and in_vocab
    [B, T] (the full-vocabulary argmax is a draft token), streamed over row chunks."""
    B, T, _ = hL.shape
    P = torch.empty(B, T, kept.numel(), device=hL.device, dtype=wide(hL[:1, :1, :1]).dtype)
    iv = torch.empty(B, T, device=hL.device, dtype=torch.bool)
    for r0 in range(0, T, chunk):
        h = rms(hL[:, r0:r0 + chunk], fnorm, eps).to(tlm.dtype)
        logits = h @ tlm.T
        iv[:, r0:r0 + chunk] = t2d[logits.argmax(-1)]
        P[:, r0:r0 + chunk] = torch.softmax(wide(logits[..., kept]), dim=-1)
    return P, iv


def ttt_loss(c, W, embed, ids, mask, aux, P, iv, attend, cos, sin):
    """Sum over steps of decay^k * loss_k, loss_k averaged per sample over the positions
    that count, then over the batch. W: weights as used (under autocast: fp32 masters)."""
    B, T = ids.shape
    H, nh, nkv, hd, K, eps = c["H"], c["nh"], c["nkv"], c["hd"], c["K"], c["eps"]
    scale = hd ** -0.5
    g = aux @ W["fc"].T
    keys, vals = [], []
    total = 0.0
    losses = []
    for k in range(K):
        tok = torch.zeros_like(ids)
        tok[:, : T - 1 - k] = ids[:, 1 + k:]
        e = embed[tok]
        xin = torch.cat([rms(e, W["in_ln"], eps), rms(g, W["hidden_norm"], eps)], dim=-1).to(g.dtype)
        q = (xin @ W["wq"].T).view(B, T, nh, hd).transpose(1, 2)
        kk = (xin @ W["wk"].T).view(B, T, nkv, hd).transpose(1, 2)
        vv = (xin @ W["wv"].T).view(B, T, nkv, hd).transpose(1, 2)
        q, kk = rope(q, cos[k:k + T], sin[k:k + T]), rope(kk, cos[k:k + T], sin[k:k + T])
        keys.append(kk)
        vals.append(vv)
        att = attend(q, torch.cat(keys, dim=2), torch.cat(vals, dim=2), k, scale)
        o = att.transpose(1, 2).reshape(B, T, nh * hd) @ W["wo"].T
        r = rms(g, W["hidden_norm"], eps) if c["nbr"] else g
        g1 = r + o
        hm = rms(g1, W["post_ln"], eps).to(o.dtype)
        g2 = g1 + (F.silu(hm @ W["gate"].T) * (hm @ W["up"].T)) @ W["down"].T
        logits = rms(g2, W["norm"], eps).to(o.dtype) @ W["lm_head"].T
        # Row t predicts the target's distribution at t + 1 + k; rows past the sample's end
        # have no target. Slices of P, so no per-step copy of it is kept for the backward.
        n = T - 1 - k
        lp = torch.log_softmax(wide(logits[:, :n]), dim=-1)
        w = (mask[:, 1 + k:] & iv[:, 1 + k:]).to(lp.dtype)
        per = -(P[:, 1 + k:] * lp).sum(-1)
        loss_k = ((per * w).sum(-1) / w.sum(-1).clamp(min=1.0)).mean()
        losses.append(loss_k)
        total = total + c["decay"] ** k * loss_k
        g = g2
    return total, losses


def check_against_oracle():
    """fp64 on the CPU: this implementation (both attention paths) against the oracle's
    per-row loop implementation, losses per step and every gradient."""
    sys.path.insert(0, os.path.join(HERE, "..", "tools"))
    import eagle3_oracle as orc
    c = dict(H=64, I=96, nh=4, nkv=2, hd=16, V=96, Vd=40, T=13, K=7, eps=1e-5, theta=10000.0,
             norm_before_residual=False, decay=0.8)
    g = torch.Generator().manual_seed(3)
    rn = lambda *s, std=0.2: torch.randn(*s, generator=g, dtype=torch.float64) * std
    H, I, nh, nkv, hd, V, Vd, T = (c[k] for k in ("H", "I", "nh", "nkv", "hd", "V", "Vd", "T"))
    W = {"fc": rn(H, 3 * H), "in_ln": 1 + rn(H, std=0.1), "hidden_norm": 1 + rn(H, std=0.1),
         "wq": rn(nh * hd, 2 * H), "wk": rn(nkv * hd, 2 * H), "wv": rn(nkv * hd, 2 * H), "wo": rn(H, nh * hd),
         "post_ln": 1 + rn(H, std=0.1), "gate": rn(I, H), "up": rn(I, H), "down": rn(H, I),
         "norm": 1 + rn(H, std=0.1), "lm_head": rn(Vd, H, std=0.5)}
    tgt = {"embed": rn(V, H, std=1.0), "final_norm": 1 + rn(H, std=0.1), "lm_head": rn(V, H, std=0.5)}
    x = torch.randint(0, V, (T,), generator=g)
    m = (torch.rand(T, generator=g) > 0.3).to(torch.int64)
    A, hL = rn(T, 3 * H, std=1.0), rn(T, H, std=1.0)
    counts = torch.bincount(x[m > 0], minlength=V)
    kept, _, t2d = orc.draft_vocab(counts, Vd)
    torch.set_default_dtype(torch.float64)
    ref_w = {k: v.clone().requires_grad_(True) for k, v in W.items()}
    out, total = orc.ttt(c, ref_w, tgt, x, m, A, hL, kept, t2d)
    total.backward()
    ref_l = [float(v.detach()) for v in out["loss"]] + [float(total.detach())]
    ref_g = {k: v.grad.detach() for k, v in ref_w.items()}
    pc = dict(H=H, nh=nh, nkv=nkv, hd=hd, K=c["K"], eps=c["eps"], nbr=False, decay=c["decay"])
    worst = {}

    def run(name, dev, dtype, make_attend, grads):
        cos, sin = rope_tables(T, c["K"], hd, c["theta"], dev)
        cv = lambda v: v.to(dev, dtype)
        P, iv = target_side(cv(hL)[None], cv(tgt["final_norm"]), cv(tgt["lm_head"]), kept.to(dev), t2d.to(dev),
                            c["eps"], chunk=5)
        mine_w = {k: cv(v).requires_grad_(grads) for k, v in W.items()}
        with torch.set_grad_enabled(grads):
            mtotal, mlosses = ttt_loss(pc, mine_w, cv(tgt["embed"]), x[None].to(dev), (m[None] > 0).to(dev),
                                       cv(A)[None], P, iv, make_attend(), cos.to(dtype), sin.to(dtype))
        got = [float(v.detach()) for v in mlosses] + [float(mtotal.detach())]
        e = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(got, ref_l))
        if grads:
            mtotal.backward()
            for k in W:
                ge = (mine_w[k].grad.double().cpu() - ref_g[k]).abs().max() / ref_g[k].abs().max().clamp(min=1e-30)
                e = max(e, float(ge))
        worst[name] = e
        print(f"check ({name}, T={T}, K={c['K']}): loss {got[-1]:.6f} vs oracle {ref_l[-1]:.6f}; worst relative "
              f"error over {'losses and gradients' if grads else 'losses'} {e:.2e}")

    run("sdpa attention, fp64, CPU", "cpu", torch.float64, lambda: SdpaTtt(T, c["K"], "cpu"), True)
    # flex attention has no CPU backward: its forward here, forward and backward on a GPU.
    run("flex attention, fp64, CPU, forward", "cpu", torch.float64,
        lambda: FlexTtt(T, c["K"], "cpu", compiled=False), False)
    if torch.cuda.is_available():
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        run("flex attention, fp32, GPU", "cuda", torch.float32, lambda: FlexTtt(T, c["K"], "cuda", compiled=True), True)
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.set_default_dtype(torch.float32)
    bars = {n: (1e-4 if "fp32" in n else 1e-9) for n in worst}
    bad = {n: e for n, e in worst.items() if not e < bars[n]}
    if bad:
        raise SystemExit(f"check FAILED: the peer disagrees with the oracle: {bad}")
    return worst


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=1, help="samples per optimizer step")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps; the first 2 warm up")
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--attention", default="flex", choices=["flex", "sdpa"])
    ap.add_argument("--compile", default="full", choices=["none", "target", "full"],
                    help="torch.compile nothing, the target step, or the whole TTT loss too")
    ap.add_argument("--peak-tflops", type=float, default=779.0)
    ap.add_argument("--loss-share", type=float, default=1.0,
                    help="share of tokens loss-masked, as 512-token prompt/answer turns (as talon_bench_train)")
    ap.add_argument("--head-skew", type=float, default=0.5,
                    help="scale of the target lm_head rows outside the draft vocab (as talon_bench_train)")
    ap.add_argument("--check-only", action="store_true")
    a = ap.parse_args()

    check_against_oracle()
    if a.check_only or not torch.cuda.is_available():
        if not a.check_only:
            print("no GPU: only the correctness check ran")
        return
    dev = "cuda"
    H, I, nh, nkv, hd, V, theta = SHAPES[a.shape]
    Vd, T, B, K = min(a.draft_vocab, V), a.seq, a.samples, a.ttt
    c = dict(H=H, I=I, nh=nh, nkv=nkv, hd=hd, Vd=Vd, K=K, eps=1e-5, nbr=False, decay=0.8)
    gen = torch.Generator().manual_seed(1)
    W = {k: torch.nn.Parameter(v) for k, v in init_weights(c, gen, dev).items()}
    embed = (torch.randn(V, H, generator=gen) * 0.02).to(dev, torch.bfloat16)
    tlm = (torch.randn(V, H, generator=gen) * 0.02).to(dev, torch.bfloat16)
    fnorm = torch.ones(H, device=dev)
    ids = torch.randint(0, V, (B, T), generator=gen).to(dev)
    prompt = round(512 * (1.0 - a.loss_share))
    mask = (torch.arange(T, device=dev) % 512 >= prompt).expand(B, T).contiguous()
    aux = torch.randn(B, T, 3 * H, generator=gen).to(dev, torch.bfloat16)
    hL = torch.randn(B, T, H, generator=gen).to(dev, torch.bfloat16)
    counts = torch.bincount(ids.flatten().cpu(), minlength=V)
    kept = torch.sort(torch.argsort(-counts.double(), stable=True)[:Vd]).values.to(dev)
    t2d = torch.zeros(V, dtype=torch.bool, device=dev)
    t2d[kept] = True
    tlm[~t2d] *= a.head_skew
    cos, sin = rope_tables(T, K, hd, theta, dev)
    cos, sin = cos.float(), sin.float()
    attend = FlexTtt(T, K, dev, compiled=a.compile != "none") if a.attention == "flex" else SdpaTtt(T, K, dev)
    target = torch.compile(target_side) if a.compile != "none" else target_side
    loss_fn = torch.compile(ttt_loss) if a.compile == "full" else ttt_loss
    decay = [p for n, p in W.items() if n not in NORMS]
    no_decay = [p for n, p in W.items() if n in NORMS]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
    torch.cuda.reset_peak_memory_stats()
    # A step is timed from the previous step's end to its own, as talon_bench_train times Talon's:
    # the loss is read back once a step (the one sync), the update is left in flight, and the next
    # step's host work overlaps it; in the steady state each interval holds one step of device
    # work. Step 0 ends with the device drained; step 1's interval (nothing in flight before it)
    # is left out like step 0's.
    times = []
    t_prev = None
    for st in range(a.steps):
        P, iv = target(hL, fnorm, tlm, kept, t2d, 1e-5)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            total, _ = loss_fn(c, W, embed, ids, mask, aux, P, iv, attend, cos, sin)
        total.backward()
        loss = float(total)
        torch.nn.utils.clip_grad_norm_(list(W.values()), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if st == 0:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        dt = t1 - t_prev if t_prev is not None else 0.0
        if t_prev is not None:
            times.append(dt)
        t_prev = t1
        print(f"step {st}: {dt:.3f} s, loss {loss:.4f}", flush=True)
    torch.cuda.synchronize()
    med = statistics.median(times[1:]) if len(times) > 1 else times[-1]
    tps = B * T / med
    layer = nh * hd * 2 * H + 2 * nkv * hd * 2 * H + H * nh * hd + 3 * I * H
    per_tok = K * (6 * layer + 6 * Vd * H) + 4 * H * 3 * H + 2 * V * H
    peak_gib = torch.cuda.max_memory_allocated() / 2**30
    # What the process holds at its peak: the allocator's reserved pool (allocated tensors plus
    # its caching and fragmentation), the figure comparable to memory taken with cudaMalloc.
    reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    print(f"peer: shape {a.shape} seq {T} x {B} samples, K={K}, attention {a.attention}, compile {a.compile}: "
          f"{tps:.0f} tokens/s (median of {max(1, len(times) - 1)} steps), {per_tok / 1e9:.1f} GFLOP/token "
          f"(no attention), {100 * tps * per_tok / (a.peak_tflops * 1e12):.1f}% of {a.peak_tflops:.0f} TFLOP/s; "
          f"peak memory {peak_gib:.1f} GiB (reserved {reserved_gib:.1f} GiB)")


if __name__ == "__main__":
    main()
