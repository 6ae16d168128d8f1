#!/usr/bin/env python3
"""Training-speed peer for the P-EAGLE and DFlash drafters: speculators 0.9.0's own model
classes (PEagleDraftModel, DFlashDraftModel) driven the way its trainer drives them
(speculators/train/trainer.py): bf16 hidden states under bf16 autocast, fp32 master weights,
`model(**batch, **train_call_kwargs)` with the kwargs its `get_trainer_kwargs` returns, the
loss's backward, clip_grad_norm_(1.0), torch.optim.AdamW. Random weights and features of a
target shape; speed does not depend on the values. Prints one JSON line: tokens/s (median of
the timed steps, tokens = the sample's positions), step time, peak allocated memory.

It is the peer of `talon_bench_train --drafter peagle|dflash` on the same shape, sequence
length, loss-masked share and family settings (bench/families_train_speed_gpu.sh runs both in
one call). On a machine without a GPU it runs a tiny shape on the CPU with speculators' eager
attention and eager losses: a check that the script and the package agree, not a timing.

  bench/train_peer_families.py --drafter peagle --shape smollm2 --seq 2048 --steps 8
  bench/train_peer_families.py --drafter dflash --shape smollm2 --seq 2048 --layers 5 --block 16
  bench/train_peer_families.py --drafter dflash --tiny    # CPU smoke run
"""
import argparse
import json
import statistics
import time

import torch

SHAPES = {
    # H, I, heads, kv heads, head_dim, V, rope theta (the target's; the drafts take these sizes)
    "smollm2": (576, 1536, 9, 3, 64, 49152, 100000.0),
    "llama3-8b": (4096, 14336, 32, 8, 128, 128256, 500000.0),
    "tiny": (64, 96, 4, 2, 16, 211, 10000.0),
}


def speculators_config(algorithm, tokens):
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    return SpeculatorsConfig(
        algorithm=algorithm, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=tokens)],
        default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))


def set_vocab(m, V, Vd):
    """Fresh weights (N(0, 0.02) matrices, unit norms, as Talon starts a draft) and the draft
    vocabulary: the first Vd target ids (t2d / d2t as speculators stores them)."""
    kept = torch.arange(Vd)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[kept] = True
        m.t2d.copy_(t2d)
        m.d2t.copy_(kept - torch.arange(Vd))


def build(a, device):
    H, I, nh, nkv, hd, V, theta = SHAPES[a.shape]
    Vd = min(a.draft_vocab, V)
    attn = "eager" if device == "cpu" else None  # None: the model's own choice (flex attention)
    if a.drafter == "peagle":
        from transformers import LlamaConfig
        from speculators.models.peagle import core
        from speculators.models.peagle.config import PEagleSpeculatorConfig
        lc = LlamaConfig(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                         head_dim=hd, vocab_size=V, num_hidden_layers=1, rms_norm_eps=1e-5, rope_theta=theta,
                         max_position_embeddings=max(8192, 2 * a.seq))
        if attn:
            lc._attn_implementation = attn
        cfg = PEagleSpeculatorConfig(transformer_layer_config=lc, draft_vocab_size=Vd,
                                     eagle_aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=V - 1,
                                     speculators_config=speculators_config("peagle", a.depths))
        m = core.PEagleDraftModel(cfg)
        kwargs = core.PEagleDraftModel.get_trainer_kwargs(
            loss_fn="kl_div", loss_implementation=a.loss_impl, num_depths=a.depths, down_sample_ratio=0.7,
            down_sample_ratio_min=0.2)[0]
        n_aux = 3
    else:
        from transformers import Qwen3Config
        from speculators.models.dflash import core
        from speculators.models.dflash.config import DFlashSpeculatorConfig
        qc = Qwen3Config(hidden_size=H, intermediate_size=I, num_attention_heads=nh, num_key_value_heads=nkv,
                         head_dim=hd, vocab_size=V, num_hidden_layers=a.layers, rms_norm_eps=1e-6, rope_theta=theta,
                         max_position_embeddings=max(8192, 2 * a.seq))
        if attn:
            qc._attn_implementation = attn
        cfg = DFlashSpeculatorConfig(transformer_layer_config=qc, draft_vocab_size=Vd, block_size=a.block,
                                     aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=V - 1,
                                     speculators_config=speculators_config("dflash", a.block - 1))
        m = core.DFlashDraftModel(cfg)
        kwargs = core.DFlashDraftModel.get_trainer_kwargs(
            loss_fn=a.dflash_loss, loss_implementation=a.loss_impl, max_anchors=a.max_anchors,
            per_position_loss_weight=a.dflash_weighting, dflash_decay_gamma=4.0, dpace_alpha=0.5)[0]
        n_aux = 3
    set_vocab(m, V, Vd)
    return m.to(device), kwargs, (H, V, n_aux)


def batch_of(a, dims, device):
    """One packed sample of a.seq positions: 512-token turns, a prompt then its answer, with
    a.loss_share of each turn loss-masked (as talon_bench_train lays them out)."""
    H, V, n_aux = dims
    T = a.seq
    g = torch.Generator().manual_seed(1)
    turn = min(512, T // 2)  # talon_bench_train's 512 (smaller only in the tiny run)
    prompt = round(turn * (1.0 - a.loss_share))
    pos = torch.arange(T)
    mask = ((pos % turn) >= prompt).long()
    dt = torch.bfloat16 if device != "cpu" else torch.float32
    return {
        "hidden_states": torch.randn(1, T, n_aux * H, generator=g).to(device, dt),
        "input_ids": torch.randint(0, V - 1, (1, T), generator=g).to(device),
        "loss_mask": mask.unsqueeze(0).to(device),
        "verifier_last_hidden_states": torch.randn(1, T, H, generator=g).to(device, dt),
        "document_ids": torch.zeros(1, T, dtype=torch.long, device=device),
        "position_ids": pos.unsqueeze(0).to(device),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", choices=["peagle", "dflash"], required=True)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="timed steps (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--loss-share", type=float, default=0.675)
    ap.add_argument("--depths", type=int, default=7, help="P-EAGLE: draft positions per anchor")
    ap.add_argument("--layers", type=int, default=5, help="DFlash: decoder layers")
    ap.add_argument("--block", type=int, default=16, help="DFlash: block size")
    ap.add_argument("--max-anchors", type=int, default=512, help="DFlash: blocks per sample")
    ap.add_argument("--dflash-loss", default="ce", choices=["ce", "kl_div"])
    ap.add_argument("--dflash-weighting", default="dpace", choices=["dpace", "fixed-exp-decay"])
    ap.add_argument("--tiny", action="store_true", help="the CPU smoke run (tiny shape, a few steps)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" or a.tiny:
        device = "cpu"
        a.shape, a.seq, a.steps, a.warmup = "tiny", min(a.seq, 96), min(a.steps, 2), 1
        a.draft_vocab, a.layers, a.block, a.max_anchors = 60, min(a.layers, 2), min(a.block, 4), min(a.max_anchors, 8)
    a.loss_impl = "eager" if device == "cpu" else "fused"
    torch.manual_seed(0)
    m, kwargs, dims = build(a, device)
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    batch = batch_of(a, dims, device)
    autocast = torch.autocast(device, dtype=torch.bfloat16) if device != "cpu" else torch.autocast("cpu", enabled=False)
    times, losses = [], []
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    # A step is timed from the previous step's end to its own, as talon_bench_train times Talon's:
    # the loss is read back once a step (the one sync), the update is left in flight and the next
    # step's host work overlaps it. The first step ends with the device drained; the warm-up
    # steps, and the one after them, are not timed.
    t_prev = None
    for step in range(a.warmup + a.steps + 1):
        with autocast:
            out = m(**batch, **kwargs)
        loss = out[1]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(float(loss.detach()))
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        if step == 0 and device != "cpu":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if step > a.warmup:
            times.append(t1 - t_prev)
        t_prev = t1
    if device != "cpu":
        torch.cuda.synchronize()
    med = statistics.median(times)
    res = {"peer": "speculators 0.9.0", "drafter": a.drafter, "shape": a.shape, "seq": a.seq, "device": device,
           "tokens_per_s": a.seq / med, "step_ms": 1000 * med, "steps": len(times), "loss_first": losses[0],
           "loss_last": losses[-1], "loss_share": a.loss_share}
    if a.drafter == "peagle":
        res["depths"] = a.depths
    else:
        res.update(layers=a.layers, block=a.block, max_anchors=a.max_anchors, loss=a.dflash_loss,
                   weighting=a.dflash_weighting)
    if device != "cpu":
        res["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if not all(map(lambda x: x == x and abs(x) < 1e30, losses)):
        raise SystemExit(f"the peer's loss is not finite: {losses}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
