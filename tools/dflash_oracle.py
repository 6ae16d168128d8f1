#!/usr/bin/env python3
"""Test oracle for the DFlash drafter: speculators 0.9.0's own DFlashDraftModel (its config
class, Qwen3-style decoder layers with the target context injected as keys and values, the
anchored-block attention mask, fixed-exp-decay loss weights and its loss reduction), run in
fp64 on the CPU with eager attention. Writes random small weights, one sample in the
unshifted layout speculators trains DFlash on, the anchors, and what its model computes (with
its KL in fp64, or its own eager cross-entropy; fixed-exp-decay or D-PACE weights): the
loss, per-slot accuracy counts, and autograd's gradient of the loss for every trainable
tensor. The C++ tests (tests/draft/test_dflash.cpp) compare src/draft/dflash.cpp against it.

  pip install --no-deps speculators==0.9.0 openai datasets hs-connectors==0.9.0
  tools/dflash_oracle.py --out tests/fixtures/dflash
"""
import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3Config

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.losses.eager import ce_loss
from speculators.models.dflash import core as dflash_core
from speculators.models.dflash.config import DFlashSpeculatorConfig
from speculators.proposals.greedy import GreedyTokenProposalConfig


def kl_div_fp64(logits, targets):
    """speculators' eager kl_div_loss (KL(target || draft) per position, summed over the draft
    vocabulary), in fp64 instead of its fp32 so the fixture is an fp64 oracle; the masking,
    decay weights and reduction stay speculators' own loss_function."""
    logq = torch.nn.functional.log_softmax(logits, dim=-1)
    p = torch.nn.functional.softmax(targets, dim=-1)
    return torch.nn.functional.kl_div(logq, p, reduction="none", log_target=False).sum(dim=-1)


def build(c, seed):
    torch.manual_seed(seed)
    qc = Qwen3Config(hidden_size=c["H"], intermediate_size=c["I"], num_attention_heads=c["nh"],
                     num_key_value_heads=c["nkv"], head_dim=c["hd"], vocab_size=c["V"], num_hidden_layers=c["L"],
                     rms_norm_eps=c["eps"], rope_theta=c["theta"], max_position_embeddings=4 * c["T"])
    qc._attn_implementation = "eager"
    cfg = DFlashSpeculatorConfig(
        transformer_layer_config=qc, draft_vocab_size=c["Vd"], block_size=c["B"],
        aux_hidden_state_layer_ids=list(range(1, c["n_aux"] + 1)), mask_token_id=c["mask_token"],
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c["B"] - 1)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"])))
    m = dflash_core.DFlashDraftModel(cfg).double()
    inv = m.rotary_emb.inv_freq
    want = 1.0 / (c["theta"] ** (torch.arange(0, c["hd"], 2, dtype=torch.float64) / c["hd"]))
    assert torch.allclose(inv.double(), want, rtol=1e-6), "the rotary base is not the one recorded"
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.5))
        kept = torch.sort(torch.randperm(c["V"])[: c["Vd"]])[0]
        t2d = torch.zeros(c["V"], dtype=torch.bool)
        t2d[kept] = True
        m.t2d.copy_(t2d)
        m.d2t.copy_(kept - torch.arange(c["Vd"]))
        full_head = torch.randn(c["V"], c["H"]) * 0.6
        m.embed_tokens.weight.copy_(torch.randn(c["V"], c["H"]))
        m.lm_head.weight.copy_(torch.randn(c["Vd"], c["H"]) * 0.4)
        # The C++ side reads fp32 copies: every value is made exactly representable in fp32.
        for p in list(m.parameters()) + [full_head]:
            p.copy_(p.float().double())
        m.verifier_lm_head.weight.copy_(full_head[kept])
    return m, kept, full_head


def case(c, seed):
    m, kept, full_head = build(c, seed)
    T, H, V, B = c["T"], c["H"], c["V"], c["B"]
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (T,), generator=g)
    mask = (torch.rand(T, generator=g) < 0.8).long()
    mask[: c["prompt"]] = 0
    aux = torch.randn(T, c["n_aux"] * H, generator=g).float().double()
    hidden = torch.randn(T, H, generator=g).float().double()
    # Anchors as speculators draws them: loss-masked positions outside the last B.
    pool = [a for a in range(T - B) if mask[a]]
    pick = torch.randperm(len(pool), generator=g)[: c["anchors"]]
    anchors = torch.sort(torch.tensor(pool)[pick])[0]
    dflash_core.select_anchors = lambda *_: (anchors, torch.ones(anchors.numel(), dtype=torch.bool))
    loss, metrics = m(hidden_states=aux.unsqueeze(0), input_ids=ids.unsqueeze(0), loss_mask=mask.unsqueeze(0),
                      verifier_last_hidden_states=hidden.unsqueeze(0), document_ids=torch.zeros(1, T, dtype=torch.long),
                      loss_config={"kl_div": (kl_div_fp64, 1.0)} if c["loss"] == "kl" else {"ce": (ce_loss, 1.0)},
                      gamma=c["gamma"], per_position_loss_weight=c["weighting"], dpace_alpha=c["alpha"],
                      max_anchors=anchors.numel())[1:]
    loss.backward()
    out = {
        "ids": ids.to(torch.int32), "mask": mask.to(torch.uint8), "aux": aux.float(), "hidden": hidden.float(),
        "anchors": anchors.to(torch.int64), "kept": kept.to(torch.int64), "target_lm_head": full_head.float(),
        "loss": loss.detach().double().reshape(1),
        "acc_sum": torch.stack([metrics[f"position_{i}_acc_sum"] for i in range(1, B)]).double(),
        "acc_total": torch.stack([metrics[f"position_{i}_acc_total"] for i in range(1, B)]).double(),
    }
    for name, p in m.named_parameters():
        if name == "verifier_lm_head.weight":
            continue
        out["w." + name] = p.detach().float().contiguous()
        if p.requires_grad:
            out["g." + name] = p.grad.detach().contiguous()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    base = dict(H=32, I=48, nh=4, nkv=2, hd=8, V=96, Vd=40, eps=1e-6, theta=10000.0, T=26, prompt=4, L=2, n_aux=3,
                B=4, anchors=5, mask_token=95, gamma=4.0, loss="kl", weighting="fixed-exp-decay", alpha=0.5)
    cases = [("gqa2", {}, 21),
             ("mha1", {"nkv": 4, "L": 1, "n_aux": 2, "B": 5, "T": 30, "anchors": 6, "loss": "ce", "weighting": "dpace"}, 22),
             ("gqa3", {"L": 3, "B": 8, "T": 40, "anchors": 4, "weighting": "dpace", "alpha": 0.3}, 23)]
    for name, over, seed in cases:
        c = {**base, **over}
        out = case(c, seed)
        meta = {k: str(v) for k, v in c.items()}
        save_file(out, os.path.join(a.out, f"dflash_{name}.safetensors"), metadata=meta)
        print(name, "loss", float(out["loss"]), "anchors", out["anchors"].tolist(),
              "acc", out["acc_sum"].tolist(), "/", out["acc_total"].tolist())
        print("  tensors:", sorted(k for k in out if k.startswith("g.")))


if __name__ == "__main__":
    main()
