#!/usr/bin/env python3
"""The peer for the drafter families' training speed: speculators 0.9.0's own P-EAGLE or DFlash
model, trained the way its Trainer runs a step, on random features of one export's shape.

usage: families_peer.py EXPORT_DIR [--tokens N] [--steps S] [--warmup W] [--loss-share F]
                        [--device cuda|cpu] [--depths K] [--max-anchors A] [--lr LR]

EXPORT_DIR is a `talon export --format speculators` directory of a P-EAGLE or DFlash run; its
config (read by speculators' own loader and schema) picks the model class and every size, and
its weights are loaded (the verifier's head and norm, which speculators does not save, are
random: they do not change the work). Each step is what speculators' Trainer.train_epoch does:
the forward under torch.autocast(bfloat16) with the family's get_trainer_kwargs() (its default
loss: KL for P-EAGLE, CE for DFlash; the fused implementation on a GPU, eager on the CPU),
zero_grad, backward, clip_grad_norm_(1.0), AdamW (fused on a GPU).

The features are one packed sequence of N tokens a step: aux hidden states and the verifier's
last hidden states from N(0, 1), random ids, and a loss mask of alternating prompt and answer
spans with the given share of answer tokens (chat-like: the families sample anchors and chains
only where the loss counts, so the share changes their work).

Prints one JSON line: family, tokens a step, steps, seconds, tokens/s, peak memory (GPU).
"""
import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the verifier's config is not needed to time a step

import torch
from safetensors.torch import load_file

from speculators import SpeculatorModelConfig
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("export_dir")
ap.add_argument("--tokens", type=int, default=4096)
ap.add_argument("--steps", type=int, default=20)
ap.add_argument("--warmup", type=int, default=3)
ap.add_argument("--loss-share", type=float, default=0.675)
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--depths", type=int, default=8, help="P-EAGLE: parallel depths (num_depths)")
ap.add_argument("--max-anchors", type=int, default=None, help="anchors a step (family default when unset)")
ap.add_argument("--lr", type=float, default=1e-4)
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
if not 0 < a.loss_share <= 1:
    ap.error(f"--loss-share must be in (0, 1], got {a.loss_share}")
if a.tokens < 16 or a.steps < 1 or a.warmup < 0:
    ap.error("--tokens >= 16, --steps >= 1 and --warmup >= 0 expected")
torch.manual_seed(a.seed)
dev = torch.device(a.device)
gpu = dev.type == "cuda"

cfg = SpeculatorModelConfig.from_pretrained(a.export_dir)
if isinstance(cfg, PEagleSpeculatorConfig):
    family, cls = "peagle", PEagleDraftModel
elif isinstance(cfg, DFlashSpeculatorConfig):
    family, cls = "dflash", DFlashDraftModel
else:
    raise SystemExit(f"{a.export_dir}: config is {type(cfg).__name__}, not P-EAGLE or DFlash")
if not gpu:  # flash/sdpa kernels are the GPU's; the CPU smoke run uses the eager path
    cfg.transformer_layer_config._attn_implementation = "eager"
model = cls(cfg)
missing, unexpected = model.load_state_dict(load_file(f"{a.export_dir}/model.safetensors"), strict=False)
if unexpected:
    raise SystemExit(f"{a.export_dir}: keys speculators does not know: {unexpected}")
with torch.no_grad():  # what the export leaves out (the verifier's norm and head): defined values
    sd = model.state_dict()
    for name in missing:
        t = sd[name]
        if t.is_floating_point():
            t.fill_(1.0) if name.endswith("norm.weight") else t.normal_(0.0, 0.02)
model.to(dev).train()

kwargs = {"loss_fn": "kl_div" if family == "peagle" else "ce", "loss_implementation": "fused" if gpu else "eager",
          "num_depths": a.depths}
if a.max_anchors is not None:
    kwargs["max_anchors"] = a.max_anchors
call_kwargs, _ = cls.get_trainer_kwargs(**kwargs)

params = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(params, lr=a.lr, fused=gpu)

H = cfg.transformer_layer_config.hidden_size
V = cfg.transformer_layer_config.vocab_size
n_aux = 3
if family == "dflash" and getattr(cfg, "aux_hidden_state_layer_ids", None):
    n_aux = len(cfg.aux_hidden_state_layer_ids)
if family == "peagle" and getattr(cfg, "eagle_aux_hidden_state_layer_ids", None):
    n_aux = len(cfg.eagle_aux_hidden_state_layer_ids)
T = a.tokens


def loss_mask(T, share, span=64):
    """Prompt spans of `span` tokens (0) alternating with answer spans (1), `share` of the
    tokens in answers; all answer when share is 1."""
    if share >= 1:
        return torch.ones(T)
    answer = max(1, round(span * share / (1 - share)))
    pattern = torch.cat([torch.zeros(span), torch.ones(answer)])
    return pattern.repeat(T // len(pattern) + 1)[:T]


batch = {
    "hidden_states": torch.randn(1, T, n_aux * H, device=dev),
    "verifier_last_hidden_states": torch.randn(1, T, H, device=dev),
    "input_ids": torch.randint(0, V, (1, T), device=dev),
    "loss_mask": loss_mask(T, a.loss_share).unsqueeze(0).to(dev),
    "document_ids": torch.zeros(1, T, dtype=torch.long, device=dev),
    "position_ids": torch.arange(T, device=dev).unsqueeze(0),
}


def step():
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        _, loss, _ = model(**batch, **call_kwargs)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss


def sync():
    if gpu:
        torch.cuda.synchronize(dev)


for _ in range(a.warmup):
    step()
sync()
if gpu:
    torch.cuda.reset_peak_memory_stats(dev)
t0 = time.perf_counter()
for _ in range(a.steps):
    loss = step()
sync()
dt = time.perf_counter() - t0
loss = float(loss.detach())
if loss != loss or abs(loss) == float("inf"):
    raise SystemExit(f"non-finite loss {loss}")
out = {"family": family, "tokens_per_step": T, "loss_share": a.loss_share, "steps": a.steps,
       "seconds": round(dt, 4), "tokens_per_s": round(a.steps * T / dt, 1), "last_loss": round(loss, 5),
       "device": torch.cuda.get_device_name(dev) if gpu else "cpu"}
if gpu:
    out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 3)
print(json.dumps(out))
