#!/usr/bin/env python3
"""The reference drafter of bench/quality_vs_specforge.sh: SpecForge 0.2.0's own EAGLE-3 code
trained on Talon's extract features.

What comes from SpecForge (imported from the installed `specforge==0.2.0` package, unmodified):
the draft model `LlamaForCausalLMEagle3` (sdpa attention backend, the explicit TTT cache path),
the TTT model `OnlineEagle3Model`, its loss `LogSoftmaxLoss` (Triton), the offline sample
normaliser `normalize_offline_sample`, the frozen `TargetHead` and its one-token shift, the
step `Eagle3TrainStrategy.forward_loss` (loss = sum_k 0.8^k loss_k), the optimizer
`BF16Optimizer` (bf16 weights, fp32 AdamW masters, clip 0.5, linear warm-up + cosine) and its
SGLang save path (`save_pretrained` without the embedding + `apply_legacy_rope_scaling`).

What comes from Talon, so both trainers see the same job: the features (aux h[2], h[15], h[27]
and h[30] of an extract dataset; h[30] goes through the target's final norm here, since
SpecForge's offline `hidden_state` is the normed state its TargetHead projects), the samples as
`talon train` loads them (shards in order, truncated to --max-length, < 2 tokens dropped), its
held-back split and per-epoch sample order (splitmix64, replicated below), and its draft
vocabulary rule (the Vd most frequent loss-masked tokens of the training split).

Two things are switched off that change no number: torch.compile (TORCHDYNAMO_DISABLE=1,
set by the caller: the same ops run eagerly, no compile time in a short job) and the
`torch.cuda.empty_cache()` that OnlineEagle3Model.forward calls on every step.

Modes:
  plan     --feat DIR --epochs E --eval-fraction F [--warmup-ratio R]: training samples,
           optimizer steps and warm-up steps, as `key=value` lines for the shell
  train    --feat DIR --gguf FILE --seed S --out DIR ...: one seed; writes DIR/config.json,
           DIR/model.safetensors (SGLang layout) and DIR/train.jsonl
  speed    --lengths FILE [--max-steps N]: the train step on random weights and features of
           SmolLM2's shapes, timed (to size a job before the features exist)
  heldout  --feat DIR --gguf FILE --seed S --draft DIR [DIR ...] --json OUT: held-back acc_k,
           cond acc_k and simulated acceptance length with `talon train`'s definitions, for
           any SGLang-format draft (SpecForge's save or `talon export --format sglang`)
"""
import argparse
import json
import math
import os
import struct
import sys
import time

import numpy as np

M64 = (1 << 64) - 1


# ---------------------------------------------------------------- Talon's seeded orders
class SplitMix64:
    def __init__(self, seed):
        self.s = seed & M64

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & M64
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        return z ^ (z >> 31)


def epoch_order(n, seed, epoch):
    """src/train/trainer.cpp epoch_order(): Fisher-Yates with splitmix64."""
    o = list(range(n))
    r = SplitMix64((seed * 1000003 + (epoch & M64) * 7919 + 1) & M64)
    for i in range(n - 1, 0, -1):
        j = r.next() % (i + 1)
        o[i], o[j] = o[j], o[i]
    return o


def split_eval(n, seed, fraction):
    """Trainer::split_eval(): indices of the held-back samples and of the training ones."""
    n_eval = int(math.floor(fraction * n + 0.5))  # llround, fraction * n >= 0
    n_eval = min(max(n_eval, 1), n - 1) if fraction > 0 and n >= 2 else 0
    pick = epoch_order(n, seed ^ 0x5EED5EED, -1)
    is_eval = [False] * n
    for i in range(n_eval):
        is_eval[pick[i]] = True
    return [i for i in range(n) if is_eval[i]], [i for i in range(n) if not is_eval[i]]


def draft_vocab(samples, train_idx, V, vd):
    """build_draft_vocab(): kept ids ascending, d2t offsets, t2d flags."""
    counts = np.zeros(V, dtype=np.int64)
    for i in train_idx:
        ids, mask = samples[i]["ids"], samples[i]["mask"]
        np.add.at(counts, ids[mask.astype(bool)], 1)
    order = np.argsort(-counts, kind="stable")
    kept = [int(t) for t in order[:vd] if counts[t] > 0]
    used = np.zeros(V, dtype=bool)
    used[kept] = True
    j = 0
    while len(kept) < vd:
        if not used[j]:
            kept.append(j)
            used[j] = True
        j += 1
    kept.sort()
    kept = np.array(kept, dtype=np.int64)
    return kept - np.arange(vd, dtype=np.int64), used


# ---------------------------------------------------------------- target weights (GGUF)
def read_gguf(path, names):
    """The few tensors the draft needs, dequantised to fp32 (F32, F16, Q8_0, Q4_0, Q4_1),
    and the metadata."""
    with open(path, "rb") as f:
        buf = f.read()
    off = 0

    def take(fmt):
        nonlocal off
        v = struct.unpack_from("<" + fmt, buf, off)
        off += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal off
        n = take("Q")
        s = buf[off:off + n].decode("utf-8", "replace")
        off += n
        return s

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(t):
        if t in scalar:
            return take(scalar[t])
        if t == 8:
            return string()
        if t == 9:
            et, n = take("I"), take("Q")
            return [value(et) for _ in range(n)]
        raise ValueError(f"gguf value type {t}")

    assert buf[:4] == b"GGUF", "not a GGUF file"
    off = 4
    take("I")  # version
    n_tensors, n_kv = take("Q"), take("Q")
    meta = {}
    for _ in range(n_kv):
        k = string()
        t = take("I")
        v = value(t)
        if t != 9 or k.startswith("llama.") or k.startswith("general."):
            meta[k] = v
    infos = {}
    for _ in range(n_tensors):
        name = string()
        nd = take("I")
        dims = [take("Q") for _ in range(nd)]
        infos[name] = (dims, take("I"), take("Q"))
    align = int(meta.get("general.alignment", 32))
    base = (off + align - 1) // align * align
    out = {}
    for name in names:
        if name not in infos:
            continue
        dims, typ, o = infos[name]
        n = int(np.prod(dims))
        p = base + o
        if typ == 0:
            a = np.frombuffer(buf, np.float32, n, p).copy()
        elif typ == 1:
            a = np.frombuffer(buf, np.float16, n, p).astype(np.float32)
        elif typ == 8:  # Q8_0: fp16 scale, 32 int8
            blk = np.frombuffer(buf, np.uint8, n // 32 * 34, p).reshape(-1, 34)
            d = blk[:, :2].copy().view(np.float16).astype(np.float32)
            q = blk[:, 2:].copy().view(np.int8).astype(np.float32)
            a = (d * q).reshape(-1)
        elif typ in (2, 3):  # Q4_0 (scale, 16 bytes) / Q4_1 (scale, min, 16 bytes)
            bs = 18 if typ == 2 else 20
            blk = np.frombuffer(buf, np.uint8, n // 32 * bs, p).reshape(-1, bs)
            d = blk[:, :2].copy().view(np.float16).astype(np.float32)
            qs = blk[:, bs - 16:]
            q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.float32)
            if typ == 2:
                a = (d * (q - 8)).reshape(-1)
            else:
                m = blk[:, 2:4].copy().view(np.float16).astype(np.float32)
                a = (d * q + m).reshape(-1)
        else:
            raise ValueError(f"{name}: gguf tensor type {typ} not handled here")
        out[name] = a.reshape(list(reversed(dims)))
    return out, meta


class Target:
    """Embedding, final norm and lm_head of a llama-family GGUF (SmolLM2 ties lm_head to the
    embedding), plus the sizes the draft takes from it."""

    def __init__(self, gguf):
        w, m = read_gguf(gguf, ["token_embd.weight", "output_norm.weight", "output.weight"])
        self.embed = w["token_embd.weight"]
        self.final_norm = w["output_norm.weight"]
        self.lm_head = w.get("output.weight", self.embed)
        self.H = int(m["llama.embedding_length"])
        self.V = int(self.embed.shape[0])
        self.L = int(m["llama.block_count"])
        self.I = int(m["llama.feed_forward_length"])
        self.heads = int(m["llama.attention.head_count"])
        self.kv_heads = int(m.get("llama.attention.head_count_kv", self.heads))
        self.head_dim = int(m.get("llama.rope.dimension_count", self.H // self.heads))
        self.eps = float(m["llama.attention.layer_norm_rms_epsilon"])
        self.theta = float(m.get("llama.rope.freq_base", 10000.0))
        self.ctx = int(m.get("llama.context_length", 2048))


# ---------------------------------------------------------------- Talon's features
def load_features(feat, max_length, device):
    """Samples as Trainer::load_extracted() takes them; features stay bf16 on `device`."""
    import torch
    from safetensors import safe_open

    man = json.load(open(os.path.join(feat, "manifest.json")))
    assert man["convention"] == "input-of-layer" and man["status"] == "complete", feat
    samples = []
    for s in man["shards"]:
        with safe_open(os.path.join(feat, s["file"]), framework="pt") as f:
            ids = f.get_tensor("input_ids").long()
            mask = f.get_tensor("loss_mask")
            off = f.get_tensor("sample_offsets").tolist()
            aux = f.get_tensor("aux_hidden_states").to(device)
            hid = f.get_tensor("hidden_states").to(device)
        for i in range(len(off) - 1):
            a, T = off[i], min(off[i + 1] - off[i], max_length)
            if T < 2:
                continue
            samples.append({"ids": ids[a:a + T].numpy(), "mask": mask[a:a + T].numpy(),
                            "aux": aux[a:a + T], "hid": hid[a:a + T]})
    return man, samples


def final_norm(hid, w, eps):
    import torch
    x = hid.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ---------------------------------------------------------------- SpecForge draft config
def draft_config(tg, vd, aux_ids):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=tg.V, hidden_size=tg.H, intermediate_size=tg.I, num_hidden_layers=1,
        num_attention_heads=tg.heads, num_key_value_heads=tg.kv_heads, head_dim=tg.head_dim,
        hidden_act="silu", max_position_embeddings=tg.ctx, rms_norm_eps=tg.eps,
        rope_theta=tg.theta, tie_word_embeddings=False, pretraining_tp=1, initializer_range=0.02,
        attention_bias=False, mlp_bias=False)
    cfg.architectures = ["LlamaForCausalLMEagle3"]
    cfg.draft_vocab_size = vd
    cfg.target_hidden_size = tg.H
    cfg.norm_before_residual = False
    # SGLang's ids are output-of-layer: Talon's input-of-layer id minus one.
    cfg.eagle_config = {"eagle_aux_hidden_state_layer_ids": [int(a) - 1 for a in aux_ids],
                        "use_aux_hidden_state": True}
    return cfg


def target_head(tg, tmp, device):
    """SpecForge's TargetHead over the target's lm_head (as from_pretrained leaves it)."""
    import torch
    from specforge.modeling.target.target_head import TargetHead

    os.makedirs(tmp, exist_ok=True)
    json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": tg.H,
               "vocab_size": tg.V, "intermediate_size": tg.I, "num_hidden_layers": tg.L,
               "num_attention_heads": tg.heads, "num_key_value_heads": tg.kv_heads,
               "rms_norm_eps": tg.eps, "rope_theta": tg.theta, "tie_word_embeddings": True},
              open(os.path.join(tmp, "config.json"), "w"))
    th = TargetHead(tmp)
    with torch.no_grad():
        th.fc.weight.copy_(torch.from_numpy(tg.lm_head))
    th.freeze_weights()
    return th.eval().to(device=device, dtype=torch.bfloat16)


# ---------------------------------------------------------------- modes
def cmd_plan(a):
    man = json.load(open(os.path.join(a.feat, "manifest.json")))
    n = 0
    for s in man["shards"]:
        from safetensors import safe_open
        with safe_open(os.path.join(a.feat, s["file"]), framework="np") as f:
            off = f.get_tensor("sample_offsets")
        n += int(sum(1 for i in range(len(off) - 1) if min(off[i + 1] - off[i], a.max_length) >= 2))
    ev, tr = split_eval(n, 0, a.eval_fraction)
    steps = (len(tr) + a.batch - 1) // a.batch * a.epochs
    print(f"samples={n}\nheld_back={len(ev)}\ntrain_samples={len(tr)}\nsteps={steps}\n"
          f"warmup={int(a.warmup_ratio * steps)}")


def cmd_train(a):
    import torch

    torch.cuda.empty_cache = lambda: None  # called by OnlineEagle3Model.forward each step
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.export.checkpoint_io import apply_legacy_rope_scaling
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.optimizer import BF16Optimizer
    from specforge.runtime.contracts import TrainBatch
    from specforge.training.strategies.base import Eagle3TrainStrategy

    dev = torch.device(a.device)
    if a.device == "cpu":  # local smoke test only: SpecForge's own torch reference of the loss
        import specforge.algorithms.eagle3.model as m
        from specforge.core.loss import _compute_loss

        class _Ref:
            apply = staticmethod(_compute_loss)
        m.LogSoftmaxLoss = _Ref
    t0 = time.time()
    if a.mode == "speed":  # random weights and features of the real shapes: step time only
        tg, man, samples = synthetic(a, dev)
        a.out = a.out or "/tmp/specforge_speed"
    else:
        tg = Target(a.gguf)
        man, samples = load_features(a.feat, a.max_length, dev)
    assert man["hidden_size"] == tg.H and man["final_layer_id"] == tg.L, "features of another model"
    ev, tr = split_eval(len(samples), a.seed, a.eval_fraction)
    d2t, t2d = draft_vocab(samples, tr, tg.V, a.draft_vocab)
    fnorm = torch.from_numpy(tg.final_norm).to(dev)
    print(f"loaded {len(samples)} samples ({len(tr)} train, {len(ev)} held back) in {time.time() - t0:.1f} s",
          flush=True)

    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    cfg = draft_config(tg, a.draft_vocab, man["aux_layer_ids"])
    draft = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(torch.from_numpy(tg.embed))
        draft.d2t.copy_(torch.from_numpy(d2t))
        draft.t2d.copy_(torch.from_numpy(t2d))
    draft.freeze_embedding()
    draft = draft.to(device=dev, dtype=torch.bfloat16)
    model = OnlineEagle3Model(draft_model=draft, length=a.ttt, attention_backend="sdpa")
    strategy = Eagle3TrainStrategy(model, target_head=target_head(tg, a.out + ".head", dev), ploss_decay=0.8)
    steps_per_epoch = (len(tr) + a.batch - 1) // a.batch
    total = steps_per_epoch * a.epochs
    opt = BF16Optimizer(draft, lr=a.lr, max_grad_norm=0.5, total_steps=total,
                        warmup_ratio=(a.warmup + 0.5) / total, lr_scheduler="cosine")
    assert opt.scheduler.warmup_epochs == a.warmup
    model.train()
    log = open(os.path.join(os.path.dirname(a.out) or ".", os.path.basename(a.out) + ".train.jsonl"), "w")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    peak = torch.cuda.max_memory_allocated if dev.type == "cuda" else (lambda: 0)
    t1, tokens = time.time(), 0
    for step in range(total):
        if a.mode == "speed" and step == 5:
            sync()
            t1, tokens = time.time(), 0
        if a.mode == "speed" and step == a.max_steps:
            sync()
            dt = time.time() - t1
            print(f"speed: {(step - 5) / dt * 1e3:.0f} steps/ks, {dt / (step - 5) * 1e3:.1f} ms/step, "
                  f"{tokens / dt:.0f} tok/s, peak {peak() / 2**30:.1f} GiB", flush=True)
            return
        epoch, k = divmod(step, steps_per_epoch)
        if k == 0:
            order = epoch_order(len(tr), a.seed, epoch)
        assert a.batch == 1, "batch 1 only (Talon's default; SpecForge's batch_size default)"
        s = samples[tr[order[k]]]
        raw = {"input_ids": torch.from_numpy(s["ids"]), "loss_mask": torch.from_numpy(s["mask"].astype(np.int64)),
               "aux_hidden_state": s["aux"][None], "hidden_state": final_norm(s["hid"], fnorm, tg.eps).to(
                   torch.bfloat16)[None]}
        t = normalize_offline_sample(raw, a.max_length)
        batch = TrainBatch(sample_ids=[str(step)], strategy="eagle3",
                           tensors={kk: v.to(dev) for kk, v in t.items()}, metadata={"target_repr": "hidden_state"})
        lr = opt.get_learning_rate()
        out = strategy.forward_loss(batch)
        out.loss.backward()
        gn = opt.step()
        tokens += len(s["ids"])
        if step % a.log_every == 0 or step == total - 1:
            rec = {"step": step, "epoch": epoch, "loss": float(out.loss), "lr": lr, "grad_norm": float(gn),
                   "acc_specforge": [float(x) for x in out.metrics["acces"]],
                   "tokens_per_s": tokens / (time.time() - t1)}
            log.write(json.dumps(rec) + "\n")
            log.flush()
            if step % (a.log_every * 10) == 0 or step == total - 1:
                print(f"seed {a.seed} step {step}/{total} loss {rec['loss']:.4f} acc0 {rec['acc_specforge'][0]:.3f}"
                      f" lr {lr:.2e} {rec['tokens_per_s']:.0f} tok/s", flush=True)
    train_s = time.time() - t1
    os.makedirs(a.out, exist_ok=True)
    state = {k: v for k, v in draft.state_dict().items() if "embed" not in k.lower()}
    draft.save_pretrained(a.out, state_dict=state)
    apply_legacy_rope_scaling(a.out)
    json.dump({"seed": a.seed, "steps": total, "train_seconds": train_s, "tokens": tokens,
               "tokens_per_s": tokens / train_s, "lr": a.lr, "warmup": a.warmup, "epochs": a.epochs,
               "train_samples": len(tr), "held_back": len(ev)}, open(a.out + ".done.json", "w"))
    print(f"seed {a.seed}: {total} steps in {train_s:.1f} s -> {a.out}", flush=True)


def synthetic(a, dev):
    import torch

    class T:
        pass
    tg = T()
    tg.H, tg.V, tg.L, tg.I, tg.heads, tg.kv_heads, tg.head_dim = 576, 49152, 30, 1536, 9, 3, 64
    tg.eps, tg.theta, tg.ctx = 1e-5, 100000.0, 8192
    rng = np.random.default_rng(0)
    tg.embed = (rng.standard_normal((tg.V, tg.H), dtype=np.float32) * 0.05)
    tg.lm_head = tg.embed
    tg.final_norm = np.ones(tg.H, dtype=np.float32)
    lens = json.load(open(a.lengths))
    samples = []
    g = torch.Generator(device=dev).manual_seed(0)
    for i in range(a.max_steps + 8):
        T_ = min(int(lens[(i * 7919) % len(lens)]), a.max_length)
        ids = rng.integers(0, tg.V, T_)
        mask = (rng.random(T_) < 0.7).astype(np.uint8)
        samples.append({"ids": ids, "mask": mask,
                        "aux": torch.randn(T_, 3 * tg.H, device=dev, generator=g).to(torch.bfloat16),
                        "hid": (torch.randn(T_, tg.H, device=dev, generator=g) * 3).to(torch.bfloat16)})
    return tg, {"hidden_size": tg.H, "final_layer_id": tg.L, "aux_layer_ids": [2, 15, 27]}, samples


def cmd_heldout(a):
    """acc_k, cond_acc_k, sim acceptance over the held-back split, with Talon's rule: at step k
    the draft at row t reads token x[t+1+k]; the row counts when t+1+k < T, the loss mask is set
    there and the target's full-vocab argmax at t+1+k is a draft token; acc_k = hits / rows
    per sample, then the mean over samples (Trainer::evaluate / summarize)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.utils import padding

    dev = torch.device(a.device)
    tg = Target(a.gguf)
    man, samples = load_features(a.feat, a.max_length, dev)
    ev, _ = split_eval(len(samples), a.seed, a.eval_fraction)
    head = torch.from_numpy(tg.lm_head).to(dev)
    fnorm = torch.from_numpy(tg.final_norm).to(dev)
    emb = torch.from_numpy(tg.embed).to(dev)
    tgt_arg = {}
    with torch.no_grad():
        for i in ev:
            tgt_arg[i] = (final_norm(samples[i]["hid"], fnorm, tg.eps) @ head.T).argmax(-1)
    res = {}
    for d in a.draft:
        cfg = LlamaConfig.from_pretrained(d)
        draft = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
        sd = load_file(os.path.join(d, "model.safetensors"))
        missing, unexpected = draft.load_state_dict(sd, strict=False)
        assert not unexpected and all("embed" in m for m in missing), (missing, unexpected)
        with torch.no_grad():
            draft.embed_tokens.weight.copy_(emb)
        draft = draft.to(dev).float().eval()
        t2d = draft.t2d.bool()
        d2t = draft.d2t.long()
        K = a.ttt
        acc = np.zeros(K)
        cacc = np.zeros(K)
        alen = 0.0
        with torch.no_grad():
            for i in ev:
                s = samples[i]
                T = len(s["ids"])
                ids = torch.from_numpy(s["ids"]).to(dev)[None]
                mask = torch.from_numpy(s["mask"].astype(np.int64)).to(dev).bool()
                targ = tgt_arg[i]
                inv = t2d[targ]
                hs = draft.project_hidden_states(s["aux"].float()[None])
                am = draft.prepare_decoder_attention_mask(torch.ones(1, T, dtype=torch.bool, device=dev), hs, 1, T,
                                                          0)
                pos = torch.arange(T, device=dev)[None]
                cache = [[], []]
                x = padding(ids, left=False)  # x[t+1]
                right = torch.ones(T, dtype=torch.bool, device=dev)
                prod, sa = 1.0, 1.0
                for k in range(K):
                    e = draft.embed_input_ids(x).float()
                    hs = draft.backbone(input_embeds=e, hidden_states=hs, cache_hidden=cache, attention_mask=am,
                                        position_ids=pos, past_key_values=None, use_cache=True)
                    pred = draft.compute_logits(hs)[0].argmax(-1)
                    pred_t = pred + d2t[pred]
                    tp = torch.arange(T, device=dev) + 1 + k
                    ok = tp < T
                    tpc = tp.clamp(max=T - 1)
                    counts = ok & mask[tpc] & inv[tpc]
                    hit = counts & (pred_t == targ[tpc])
                    n = int(counts.sum())
                    a_k = float(hit.sum()) / n if n else 0.0
                    cn = counts & right
                    c_k = float((hit & right).sum()) / int(cn.sum()) if int(cn.sum()) else 0.0
                    right = right & hit
                    acc[k] += a_k / len(ev)
                    cacc[k] += c_k / len(ev)
                    prod *= a_k
                    sa += prod
                    x = padding(x, left=False)
                alen += sa / len(ev)
        res[d] = {"acc": acc.tolist(), "cond_acc": cacc.tolist(), "sim_accept_len": alen, "samples": len(ev)}
        print(f"{d}: acc {' '.join(f'{v:.3f}' for v in acc)} sim tau {alen:.3f}", flush=True)
    json.dump(res, open(a.json, "w"), indent=1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["plan", "train", "heldout", "speed"])
    p.add_argument("--feat")
    p.add_argument("--gguf")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out")
    p.add_argument("--draft", nargs="*", default=[])
    p.add_argument("--json")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--warmup-ratio", type=float, default=0.015)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ttt", type=int, default=7)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--max-length", type=int, default=2048)
    p.add_argument("--eval-fraction", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for a local smoke test")
    p.add_argument("--max-steps", type=int, default=45, help="speed: steps (the first 5 untimed)")
    p.add_argument("--lengths", help="speed: JSON list of sample lengths to draw from")
    a = p.parse_args()
    {"plan": cmd_plan, "train": cmd_train, "heldout": cmd_heldout, "speed": cmd_train}[a.mode](a)


if __name__ == "__main__":
    sys.exit(main())
