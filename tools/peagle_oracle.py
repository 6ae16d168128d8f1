#!/usr/bin/env python3
"""Test oracle for the P-EAGLE drafter: speculators 0.9.0's own PEagleDraftModel (its config
class, first layer, COD sampling, attention mask and loss), run in fp64 on the CPU with
eager attention. Writes random small weights, one sample in Talon's unshifted layout, the COD
sample speculators drew for it, and what its model computes: the loss, per-depth accuracy
counts, and autograd's gradient of the loss for every trainable tensor. The C++ tests
(tests/draft/test_peagle.cpp) compare src/draft/peagle.cpp against it.

  pip install --no-deps speculators==0.9.0 openai datasets hs-connectors==0.9.0
  tools/peagle_oracle.py --out tests/fixtures/peagle

Layouts. Talon's sample: ids[T], mask[T], aux[T, 3H] (the three aux layers at position t),
hidden[T, H] (the last layer). speculators trains on the batch its shift_batch makes of it
(input ids[1:], aux[:-1], hidden[1:], mask[1:]); its element (anchor a, depth d) sits at
shifted position a + d, which is Talon's position t = a + d: the input token ids[a+1] (depth
0) or the mask token, the target distribution from hidden[a+d+1], counted when mask[a+d+1].
"""
import argparse
import os

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

from speculators.config import SpeculatorsConfig, VerifierConfig
from speculators.models.eagle3.data import shift_batch
from speculators.models.peagle import core as peagle_core
from speculators.models.peagle.config import PEagleSpeculatorConfig
from speculators.models.peagle.data import generate_cod_sample_indices
from speculators.proposals.greedy import GreedyTokenProposalConfig


def kl_div_fp64(logits, targets):
    """speculators' eager kl_div_loss (KL(target || draft) per position, summed over the draft
    vocabulary), in fp64 instead of its fp32 so the fixture is an fp64 oracle; the reduction
    (mask, mean over counted elements) stays speculators' own loss_function."""
    logq = torch.nn.functional.log_softmax(logits, dim=-1)
    p = torch.nn.functional.softmax(targets, dim=-1)
    return torch.nn.functional.kl_div(logq, p, reduction="none", log_target=False).sum(dim=-1)


def build(c, seed):
    torch.manual_seed(seed)
    lc = LlamaConfig(hidden_size=c["H"], intermediate_size=c["I"], num_attention_heads=c["nh"],
                     num_key_value_heads=c["nkv"], head_dim=c["hd"], vocab_size=c["V"], num_hidden_layers=1,
                     rms_norm_eps=c["eps"], rope_theta=c["theta"], max_position_embeddings=4 * c["T"])
    lc._attn_implementation = "eager"
    cfg = PEagleSpeculatorConfig(
        transformer_layer_config=lc, draft_vocab_size=c["Vd"], norm_before_residual=c["nbr"],
        eagle_aux_hidden_state_layer_ids=[1, 2, 3], mask_token_id=c["mask_token"],
        speculators_config=SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=c["depths"])],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    m = peagle_core.PEagleDraftModel(cfg).double()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.5))
        # Every parameter random, then the draft vocabulary: the verifier's lm_head rows of
        # the kept ids are both the target head and the draft's (frozen) lm_head.
        kept = torch.sort(torch.randperm(c["V"])[: c["Vd"]])[0]
        t2d = torch.zeros(c["V"], dtype=torch.bool)
        t2d[kept] = True
        m.t2d.copy_(t2d)
        m.d2t.copy_(kept - torch.arange(c["Vd"]))
        full_head = torch.randn(c["V"], c["H"]) * 0.6
        m.verifier_lm_head.weight.copy_(full_head[kept])
        m.lm_head.weight.copy_(torch.randn(c["Vd"], c["H"]) * 0.4)
        # The C++ side reads fp32 copies: every value is made exactly representable in fp32.
        for p in list(m.parameters()) + [full_head]:
            p.copy_(p.float().double())
        m.verifier_lm_head.weight.copy_(full_head[kept])
    return m, kept, full_head


def case(c, seed):
    m, kept, full_head = build(c, seed)
    T, H, V = c["T"], c["H"], c["V"]
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, V, (T,), generator=g)
    mask = (torch.rand(T, generator=g) < 0.8).long()
    mask[: c["prompt"]] = 0
    aux = torch.randn(T, 3 * H, generator=g).float().double()
    hidden = torch.randn(T, H, generator=g).float().double()
    batch = shift_batch({"input_ids": ids, "hidden_states": aux, "verifier_last_hidden_states": hidden,
                         "loss_mask": mask, "lengths": torch.tensor([T]), "position_ids": torch.arange(T)})
    S = T - 1
    torch.manual_seed(seed + 2)
    anchor, depth = generate_cod_sample_indices(S, batch["loss_mask"].unsqueeze(0).float(), num_depths=c["depths"],
                                                down_sample_ratio=c["ratio"], down_sample_ratio_min=c["ratio_min"])
    # The model draws its own sample; hand it the one recorded above.
    peagle_core.generate_cod_sample_indices = lambda **_: (anchor, depth)
    loss, metrics = m(hidden_states=batch["hidden_states"].unsqueeze(0), input_ids=batch["input_ids"].unsqueeze(0),
                      document_ids=torch.zeros(1, S, dtype=torch.long), loss_mask=batch["loss_mask"].unsqueeze(0),
                      verifier_last_hidden_states=batch["verifier_last_hidden_states"].unsqueeze(0),
                      num_depths=c["depths"], loss_config={"kl_div": (kl_div_fp64, 1.0)})[1:]
    loss.backward()
    out = {
        "ids": ids.to(torch.int32), "mask": mask.to(torch.uint8), "aux": aux.float(), "hidden": hidden.float(),
        "anchor": anchor.to(torch.int64), "depth": depth.to(torch.int64), "kept": kept.to(torch.int64),
        "target_lm_head": full_head.float(),
        "loss": loss.detach().reshape(1),
        "acc_sum": torch.stack([metrics[f"position_{d}_acc_sum"] for d in range(c["depths"])]).double(),
        "acc_total": torch.stack([metrics[f"position_{d}_acc_total"] for d in range(c["depths"])]).double(),
    }
    for name, p in m.named_parameters():
        if name in ("verifier_lm_head.weight",):
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
    base = dict(H=32, I=48, nh=4, nkv=2, hd=8, V=96, Vd=40, eps=1e-5, theta=10000.0, T=24, prompt=5, depths=4,
                ratio=0.7, ratio_min=0.2, mask_token=95, nbr=False)
    for name, over, seed in [("gqa", {}, 11), ("nbr", {"nbr": True, "depths": 5, "T": 30}, 12)]:
        c = {**base, **over}
        out = case(c, seed)
        meta = {k: str(v) for k, v in c.items()}
        save_file(out, os.path.join(a.out, f"peagle_{name}.safetensors"), metadata=meta)
        print(name, "loss", float(out["loss"]), "elements", out["anchor"].shape[0],
              "acc", out["acc_sum"].tolist(), "/", out["acc_total"].tolist())


if __name__ == "__main__":
    main()
