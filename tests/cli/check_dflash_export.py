#!/usr/bin/env python3
"""Checks a DFlash `talon export` directory in speculators 0.9.0, the library that defines the
format, and against the `talon train` run it came from.

usage: check_dflash_export.py CHECKPOINT EXPORT_DIR fp32|bf16 GGUF FEATURES MAX_LENGTH EVAL_LOSS

1. Tensors: exactly DFlash's set (fc, hidden_norm, every layer's projections and norms, norm,
   lm_head, d2t, t2d; no embedding), every value the checkpoint's bits (fp32) or torch's bf16
   rounding of them.
2. Config: read by speculators' own config loader (its pydantic schema validates it) into
   DFlashSpeculatorConfig: the run's layers, block size, aux layer ids and mask token.
3. Strict load: speculators' DFlashDraftModel takes the state dict with no unexpected key, and
   the only missing keys are the ones that model itself never saves (its
   _keys_to_ignore_on_save: the verifier's lm_head and norm, and the embedding).
4. Forward: speculators' model, with the embedding and the verifier's norm and lm_head from the
   GGUF target, run in fp64 on every sample of the features with every anchor (Talon's
   evaluation sample) and the run's objective (its own eager cross-entropy or KL, D-PACE or
   fixed-exp-decay weights), reproduces Talon's held-back loss EVAL_LOSS on one of them: to
   1e-5 from the fp32 export (D-PACE's confidences are fp32 there), within bf16 tolerance (2%)
   from the bf16 one.
"""
import glob
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from export_checks import GgufTarget, check_tensors, read_checkpoint, strict_load
from speculators import SpeculatorModelConfig
from speculators.losses.eager import ce_loss
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from speculators.models.dflash import core as dflash_core

ckpt_path, out_dir, dtype, gguf_path, feat_dir, max_len, eval_loss = sys.argv[1:8]
max_len, eval_loss = int(max_len), float(eval_loss)

meta, ckpt = read_checkpoint(ckpt_path)
d, job = meta["draft"], meta["job"]
assert meta["drafter"] == "dflash", meta.get("drafter")
H, I, V, Vd = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["draft_vocab_size"]
qd, kvd, hd = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"], d["head_dim"]
L, B, NA = d["num_hidden_layers"], d["block_size"], d["num_aux_layers"]

layer = [("in_ln", "input_layernorm.weight", [H]), ("wq", "self_attn.q_proj.weight", [qd, H]),
         ("wk", "self_attn.k_proj.weight", [kvd, H]), ("wv", "self_attn.v_proj.weight", [kvd, H]),
         ("q_norm", "self_attn.q_norm.weight", [hd]), ("k_norm", "self_attn.k_norm.weight", [hd]),
         ("wo", "self_attn.o_proj.weight", [H, qd]), ("post_ln", "post_attention_layernorm.weight", [H]),
         ("gate", "mlp.gate_proj.weight", [I, H]), ("up", "mlp.up_proj.weight", [I, H]),
         ("down", "mlp.down_proj.weight", [H, I])]
table = {"fc": ("fc.weight", [H, NA * H]), "hidden_norm": ("hidden_norm.weight", [H]), "norm": ("norm.weight", [H]),
         "lm_head": ("lm_head.weight", [Vd, H])}
for l in range(L):
    for t, e, shape in layer:
        table[f"layers.{l}.{t}"] = (f"layers.{l}.{e}", shape)
sd = load_file(f"{out_dir}/model.safetensors")
check_tensors(sd, ckpt, table, dtype)

# Config through speculators' own loader and schema.
cfg = SpeculatorModelConfig.from_pretrained(out_dir)
assert isinstance(cfg, DFlashSpeculatorConfig), type(cfg)
assert cfg.mask_token_id == job["mask_token_id"] and cfg.block_size == B and cfg.draft_vocab_size == Vd, cfg
assert cfg.aux_hidden_state_layer_ids == meta["aux_layer_ids"], cfg.aux_hidden_state_layer_ids
assert cfg.transformer_layer_config.num_hidden_layers == L and not cfg.sample_from_anchor
assert cfg.speculators_config.algorithm == "dflash"
assert cfg.speculators_config.proposal_methods[0].speculative_tokens == B - 1

# Strict load.
cfg.transformer_layer_config._attn_implementation = "eager"
model = DFlashDraftModel(cfg).to(torch.float64)
strict_load(model, sd)

# The target's embedding, final norm and lm_head (tied: token_embd) from the GGUF.
deq = GgufTarget(gguf_path)
embed = deq("token_embd.weight")
head = deq.lm_head()
kept = sd["d2t"] + torch.arange(Vd)
with torch.no_grad():
    model.embed_tokens.weight.copy_(embed)
    model.verifier_lm_head.weight.copy_(head[kept])
    model.verifier_norm.weight.copy_(deq("output_norm.weight"))

loss_cfg = {"ce": (ce_loss, 1.0)} if job["dflash_loss"] == "ce" else None
if loss_cfg is None:
    from speculators.losses import resolve_loss_config
    loss_cfg = resolve_loss_config("kl_div", "eager")
losses = []
for shard in sorted(glob.glob(f"{feat_dir}/shard-*.safetensors")):
    with safe_open(shard, framework="pt") as f:
        ids, lm = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask")
        aux, hid = f.get_tensor("aux_hidden_states").double(), f.get_tensor("hidden_states").double()
        off = f.get_tensor("sample_offsets")
    for s in range(off.shape[0] - 1):
        a0 = int(off[s])
        T = min(int(off[s + 1]) - a0, max_len)
        sl = slice(a0, a0 + T)
        anchors = torch.tensor([a for a in range(T - B) if lm[sl][a]], dtype=torch.long)
        if anchors.numel() == 0:
            continue
        dflash_core.select_anchors = lambda *_: (anchors, torch.ones(anchors.numel(), dtype=torch.bool))
        with torch.no_grad():
            _, loss, _ = model(
                hidden_states=aux[sl].unsqueeze(0), input_ids=ids[sl].unsqueeze(0), loss_mask=lm[sl].unsqueeze(0),
                verifier_last_hidden_states=hid[sl].unsqueeze(0), document_ids=torch.zeros(1, T, dtype=torch.long),
                loss_config=loss_cfg, gamma=job["dflash_gamma"], per_position_loss_weight=job["dflash_weighting"],
                dpace_alpha=job["dpace_alpha"], max_anchors=anchors.numel())
        losses.append(float(loss))
tol = 1e-5 if dtype == "fp32" else 2e-2
best = min(abs(x - eval_loss) / abs(eval_loss) for x in losses)
assert best <= tol, f"no sample's loss matches Talon's held-back loss {eval_loss}: {losses} (best rel {best:.2e})"
print(f"{dtype}: strict load in speculators 0.9.0, its schema and forward agree "
      f"(held-back loss {eval_loss:.6f}, rel diff {best:.1e} over {len(losses)} samples)")
