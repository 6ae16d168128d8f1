#!/usr/bin/env python3
"""Test oracle for the EAGLE-3 draft model and training-time test (SPEC-EAGLE3 sections
2-4), written from the spec in PyTorch, fp64. Writes a fixture of random small weights,
inputs and the expected outputs (per-step logits, losses, accuracies, and autograd's
gradients of the total loss for every draft weight), which the C++ tests compare
against: tests/fixtures/eagle3/ttt_<name>.safetensors.

  tools/eagle3_oracle.py --out tests/fixtures/eagle3

Conventions pinned here (and in src/draft/): the draft vocabulary keeps the Vd most
frequent loss-masked target tokens, ties broken towards the lower id, padded with the
lowest unused ids, sorted ascending; loss_k is normalised by the number of positions
that count at step k; total = sum_k decay^k loss_k.
"""
import argparse
import os

import torch
from safetensors.torch import save_file

torch.set_default_dtype(torch.float64)


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos, theta):
    # x [T, heads, hd]; rotate (i, i + hd/2) pairs by pos * theta^(-2i/hd)
    hd = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = pos[:, None].double() * inv[None, :]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : hd // 2], x[..., hd // 2:]
    return torch.cat([a * c - b * s, b * c + a * s], dim=-1)


def draft_vocab(counts, vd):
    V = counts.shape[0]
    order = sorted(range(V), key=lambda i: (-int(counts[i]), i))
    kept = [i for i in order[:vd] if counts[i] > 0]
    used = set(kept)
    j = 0
    while len(kept) < vd:
        if j not in used:
            kept.append(j)
            used.add(j)
        j += 1
    kept = sorted(kept)
    d2t = torch.tensor([k - i for i, k in enumerate(kept)], dtype=torch.int64)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    return torch.tensor(kept), d2t, t2d


def ttt(c, W, tgt, x, m, A, hL, kept, t2d):
    T, H = A.shape[0], c["H"]
    nh, nkv, hd = c["nh"], c["nkv"], c["hd"]
    grp = nh // nkv
    # Target distribution restricted to the draft vocab, and the full-vocab argmax.
    tl = rms(hL, tgt["final_norm"], c["eps"]) @ tgt["lm_head"].T  # [T, V]
    P = torch.softmax(tl[:, kept], dim=-1)
    in_vocab = t2d[tl.argmax(-1)]
    tgt_arg = P.argmax(-1)
    t = torch.arange(T)
    g = A @ W["fc"].T
    K0 = V0 = None
    Kd, Vd_ = [], []
    out = {"loss": [], "acc": [], "n": [], "logits": [], "cond": []}
    right_so_far = torch.ones(T, dtype=torch.bool)
    for k in range(c["K"]):
        tp = t + 1 + k
        valid = tp < T
        tpc = tp.clamp(max=T - 1)
        tok = torch.where(valid, x[tpc], torch.zeros_like(x))
        e = tgt["embed"][tok]
        xin = torch.cat([rms(e, W["in_ln"], c["eps"]), rms(g, W["hidden_norm"], c["eps"])], dim=-1)
        q = (xin @ W["wq"].T).view(T, nh, hd)
        kk = (xin @ W["wk"].T).view(T, nkv, hd)
        vv = (xin @ W["wv"].T).view(T, nkv, hd)
        pos = t + k
        q, kk = rope(q, pos, c["theta"]), rope(kk, pos, c["theta"])
        if k == 0:
            K0, V0 = kk, vv
        else:
            Kd.append(kk)
            Vd_.append(vv)
        att = torch.zeros(T, nh, hd)
        scale = hd ** -0.5
        for i in range(T):
            for h in range(nh):
                kh = h // grp
                keys = [K0[: i + 1, kh]] + [Kj[i: i + 1, kh] for Kj in Kd]
                vals = [V0[: i + 1, kh]] + [Vj[i: i + 1, kh] for Vj in Vd_]
                Ks, Vs = torch.cat(keys), torch.cat(vals)
                p = torch.softmax((Ks @ q[i, h]) * scale, dim=0)
                att[i, h] = p @ Vs
        o = att.reshape(T, nh * hd) @ W["wo"].T
        r = rms(g, W["hidden_norm"], c["eps"]) if c["norm_before_residual"] else g
        g1 = r + o
        hm = rms(g1, W["post_ln"], c["eps"])
        mlp = (torch.nn.functional.silu(hm @ W["gate"].T) * (hm @ W["up"].T)) @ W["down"].T
        g2 = g1 + mlp
        logits = rms(g2, W["norm"], c["eps"]) @ W["lm_head"].T  # [T, Vd]
        w = (valid & (m[tpc] > 0) & in_vocab[tpc]).double()
        lp = torch.log_softmax(logits, dim=-1)
        per = -(P[tpc] * lp).sum(-1)
        n = w.sum()
        out["loss"].append((per * w).sum() / n if n > 0 else torch.tensor(0.0))
        hit = (logits.argmax(-1) == tgt_arg[tpc]) & (w > 0)
        out["acc"].append(hit.double().sum() / n if n > 0 else torch.tensor(0.0))
        cond_den = ((w > 0) & right_so_far).double().sum()
        out["cond"].append((hit & right_so_far).double().sum() / cond_den if cond_den > 0 else torch.tensor(0.0))
        right_so_far = right_so_far & hit
        out["n"].append(n)
        out["logits"].append(logits)
        g = g2
    total = sum(c["decay"] ** k * out["loss"][k] for k in range(c["K"]))
    return out, total


NORMS = ("in_ln", "hidden_norm", "post_ln", "norm")
TRAIN = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01, warmup=3, total=20, min_lr_ratio=0.1, clip=0.5)


def lr_lambda(s):
    import math
    w, n, lo = TRAIN["warmup"], TRAIN["total"], TRAIN["min_lr_ratio"]
    if s < w:
        return (s + 1) / w
    p = min(1.0, (s - w) / (n - w))
    return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * p))


def train_curve(c, W, tgt, x, m, A, hL, kept, t2d):
    """TRAIN["total"] AdamW steps (fp32 master weights, fp64 compute) on one sample."""
    params = {k: torch.nn.Parameter(v.detach().float().clone()) for k, v in W.items()}
    groups = [{"params": [p for k, p in params.items() if k not in NORMS], "weight_decay": TRAIN["weight_decay"]},
              {"params": [p for k, p in params.items() if k in NORMS], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=TRAIN["lr"], betas=TRAIN["betas"], eps=TRAIN["eps"], foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    losses, norms = [], []
    for _ in range(TRAIN["total"]):
        opt.zero_grad()
        _, total = ttt(c, {k: p.double() for k, p in params.items()}, tgt, x, m, A, hL, kept, t2d)
        total.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), TRAIN["clip"])))
        losses.append(float(total.detach()))
        opt.step()
        sched.step()
    return torch.tensor(losses), torch.tensor(norms), {k: p.detach().clone() for k, p in params.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    cases = {
        "gqa": dict(H=32, I=48, nh=4, nkv=2, hd=8, V=96, Vd=40, T=13, K=7, eps=1e-5, theta=10000.0,
                    norm_before_residual=False, decay=0.8, seed=1),
        "nbr": dict(H=24, I=40, nh=3, nkv=3, hd=8, V=16, Vd=8, T=24, K=4, eps=1e-6, theta=500000.0,
                    norm_before_residual=True, decay=1.0, seed=2),
    }
    for name, c in cases.items():
        g = torch.Generator().manual_seed(c["seed"])
        H, I, nh, nkv, hd, V, Vd, T = (c[k] for k in ("H", "I", "nh", "nkv", "hd", "V", "Vd", "T"))
        rn = lambda *s, std=0.2: torch.randn(*s, generator=g) * std
        W = {"fc": rn(H, 3 * H), "in_ln": 1 + rn(H, std=0.1), "hidden_norm": 1 + rn(H, std=0.1),
             "wq": rn(nh * hd, 2 * H), "wk": rn(nkv * hd, 2 * H), "wv": rn(nkv * hd, 2 * H), "wo": rn(H, nh * hd),
             "post_ln": 1 + rn(H, std=0.1), "gate": rn(I, H), "up": rn(I, H), "down": rn(H, I),
             "norm": 1 + rn(H, std=0.1), "lm_head": rn(Vd, H, std=0.5)}
        tgt = {"embed": rn(V, H, std=1.0), "final_norm": 1 + rn(H, std=0.1), "lm_head": rn(V, H, std=0.5)}
        # fp32-representable values, so the fp32 fixture and this fp64 computation agree.
        W = {k: v.float().double() for k, v in W.items()}
        tgt = {k: v.float().double() for k, v in tgt.items()}
        x = torch.randint(0, V, (T,), generator=g)
        m = (torch.rand(T, generator=g) > 0.3).to(torch.int64)
        A = rn(T, 3 * H, std=1.0).float().double()
        hL = rn(T, H, std=1.0).float().double()
        counts = torch.zeros(V, dtype=torch.int64)
        for i in range(T):
            if m[i]:
                counts[x[i]] += 1
        kept, d2t, t2d = draft_vocab(counts, Vd)
        for v in W.values():
            v.requires_grad_(True)
        out, total = ttt(c, W, tgt, x, m, A, hL, kept, t2d)
        total.backward()
        grads = {f"grad.{k}": v.grad.detach().clone() for k, v in W.items()}
        W = {k: v.detach() for k, v in W.items()}
        out = {k: [t.detach() for t in v] for k, v in out.items()}
        total = total.detach()
        f = {f"w.{k}": v.float().contiguous() for k, v in W.items()}
        f.update(grads)  # fp64 gradients of the total loss
        f.update({f"target.{k}": v.float().contiguous() for k, v in tgt.items()})
        f.update({"input_ids": x.to(torch.int32), "loss_mask": m.to(torch.uint8), "aux": A.float(), "hidden": hL.float(),
                  "counts": counts, "kept": kept, "d2t": d2t, "t2d": t2d.to(torch.uint8),
                  "loss_k": torch.stack(out["loss"]), "acc_k": torch.stack(out["acc"]),
                  "cond_acc_k": torch.stack(out["cond"]), "n_k": torch.stack(out["n"]), "loss": total.reshape(1),
                  "logits": torch.stack(out["logits"]).float()})
        if name == "gqa":
            cl, cn, final = train_curve(c, W, tgt, x, m, A, hL, kept, t2d)
            f.update({"train.loss": cl, "train.grad_norm": cn, "train.final.fc": final["fc"],
                      "train.final.norm": final["norm"]})
            print(name, "train loss", [round(float(v), 3) for v in cl])
        meta = {k: str(v) for k, v in c.items()}
        meta.update({f"train.{k}": str(v) for k, v in TRAIN.items()})
        save_file(f, os.path.join(a.out, f"ttt_{name}.safetensors"), metadata=meta)
        print(name, "loss", float(total), "acc", [round(float(v), 3) for v in out["acc"]])


if __name__ == "__main__":
    main()
