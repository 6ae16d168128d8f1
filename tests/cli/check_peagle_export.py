#!/usr/bin/env python3
"""Checks a P-EAGLE `talon export` directory in speculators 0.9.0, the library that defines
the format, and against the `talon train` run it came from.

usage: check_peagle_export.py CHECKPOINT EXPORT_DIR fp32|bf16 GGUF FEATURES MAX_LENGTH EVAL_LOSS

1. Tensors: exactly the P-EAGLE set (the EAGLE-3 layer, embed_tokens.weight [V, H],
   mask_hidden [1, 1, 3H], d2t, t2d), every value the checkpoint's bits (fp32) or torch's
   bf16 rounding of them.
2. Config: read by speculators' own config loader (its pydantic schema validates it) into
   PEagleSpeculatorConfig, with the run's mask token and draft sizes.
3. Strict load: speculators' PEagleDraftModel takes the state dict with no unexpected key,
   and the only missing keys are the ones speculators itself never saves
   (_keys_to_ignore_on_save: the verifier's lm_head and norm).
4. Forward: speculators' model, with the verifier's norm and lm_head from the GGUF target,
   run in fp64 on every sample of the features with every chain at every depth (Talon's
   evaluation sample) and its own eager KL loss, reproduces Talon's held-back loss EVAL_LOSS on
   one of them: to 1e-5 from the fp32 export (its KL is fp32), within bf16 tolerance (2%) from
   the bf16 one.
"""
import glob
import json
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from export_checks import GgufTarget, check_tensors, read_checkpoint, strict_load
from speculators import SpeculatorModelConfig
from speculators.losses import resolve_loss_config
from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
from speculators.models.peagle import core as peagle_core

ckpt_path, out_dir, dtype, gguf_path, feat_dir, max_len, eval_loss = sys.argv[1:8]
max_len, eval_loss = int(max_len), float(eval_loss)
torch.manual_seed(0)

meta, ckpt = read_checkpoint(ckpt_path)
d, job = meta["draft"], meta["job"]
H, I, V, Vd = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["draft_vocab_size"]
qd, kvd = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
K = job["ttt_steps"]
assert meta["drafter"] == "peagle", meta.get("drafter")

L = "layers.0."
table = {
    "fc": ("fc.weight", [H, 3 * H]), "in_ln": (L + "input_layernorm.weight", [H]),
    "hidden_norm": (L + "hidden_norm.weight", [H]), "wq": (L + "self_attn.q_proj.weight", [qd, 2 * H]),
    "wk": (L + "self_attn.k_proj.weight", [kvd, 2 * H]), "wv": (L + "self_attn.v_proj.weight", [kvd, 2 * H]),
    "wo": (L + "self_attn.o_proj.weight", [H, qd]), "post_ln": (L + "post_attention_layernorm.weight", [H]),
    "gate": (L + "mlp.gate_proj.weight", [I, H]), "up": (L + "mlp.up_proj.weight", [I, H]),
    "down": (L + "mlp.down_proj.weight", [H, I]), "norm": ("norm.weight", [H]),
    "lm_head": ("lm_head.weight", [Vd, H]), "embed": ("embed_tokens.weight", [V, H]),
    "mask_hidden": ("mask_hidden", [1, 1, 3 * H]),
}
sd = load_file(f"{out_dir}/model.safetensors")
check_tensors(sd, ckpt, table, dtype)

# Config through speculators' own loader and schema.
cfg = SpeculatorModelConfig.from_pretrained(out_dir)
assert isinstance(cfg, PEagleSpeculatorConfig), type(cfg)
assert cfg.mask_token_id == job["mask_token_id"] and cfg.embed_requires_grad is True, cfg.mask_token_id
assert cfg.draft_vocab_size == Vd and cfg.norm_before_residual == d["norm_before_residual"]
assert cfg.speculators_config.algorithm == "peagle"
raw = json.load(open(f"{out_dir}/config.json"))
assert raw["speculators_model_type"] == "peagle" and raw["architectures"] == ["PEagleSpeculator"], raw
assert raw["eagle_aux_hidden_state_layer_ids"] == meta["aux_layer_ids"], raw

# Strict load.
cfg.transformer_layer_config._attn_implementation = "eager"
model = PEagleDraftModel(cfg).to(torch.float64)
strict_load(model, sd)

# The verifier's head from the GGUF target (tied embeddings: lm_head = token_embd), kept rows.
deq = GgufTarget(gguf_path)
head = deq.lm_head()
kept = sd["d2t"] + torch.arange(Vd)
with torch.no_grad():
    model.verifier_lm_head.weight.copy_(head[kept])
    model.verifier_norm.weight.copy_(deq("output_norm.weight"))

# Every sample of the features, every chain at every depth (Talon's evaluation sample), in
# speculators' shifted layout (input ids[1:], aux[:-1], hidden[1:], mask[1:]).
# Depth d >= 1 of anchor a needs the target rows of positions a+1 .. a+d loss-masked (as
# speculators' sampler chains them: depth 1 starts from any loss-masked position).
def full_chains(mask):
    T = mask.shape[0]
    anchors, depths = list(range(T - 1)), [0] * (T - 1)
    for dd in range(1, K):
        for a in range(T - 1 - dd):
            if all(mask[a + 1 + j + 1] for j in range(dd)):
                anchors.append(a)
                depths.append(dd)
    return torch.tensor(anchors), torch.tensor(depths)

losses = []
for shard in sorted(glob.glob(f"{feat_dir}/shard-*.safetensors")):
    with safe_open(shard, framework="pt") as f:
        ids, lm = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask")
        aux, hid = f.get_tensor("aux_hidden_states").double(), f.get_tensor("hidden_states").double()
        off = f.get_tensor("sample_offsets")
    for s in range(off.shape[0] - 1):
        a0 = int(off[s])
        T = min(int(off[s + 1]) - a0, max_len)
        if T < 2:
            continue
        sl = slice(a0, a0 + T)
        anchor, depth = full_chains(lm[sl])
        peagle_core.generate_cod_sample_indices = lambda **_: (anchor, depth)
        with torch.no_grad():
            _, loss, _ = model(
                hidden_states=aux[sl][:-1].unsqueeze(0), input_ids=ids[sl][1:].unsqueeze(0),
                document_ids=torch.zeros(1, T - 1, dtype=torch.long), loss_mask=lm[sl][1:].unsqueeze(0).double(),
                verifier_last_hidden_states=hid[sl][1:].unsqueeze(0), num_depths=K,
                loss_config=resolve_loss_config("kl_div", "eager"))
        losses.append(float(loss))
tol = 1e-5 if dtype == "fp32" else 2e-2  # (speculators' eager KL runs in fp32)
best = min(abs(x - eval_loss) / abs(eval_loss) for x in losses)
assert best <= tol, f"no sample's loss matches Talon's held-back loss {eval_loss}: {losses} (best rel {best:.2e})"
print(f"{dtype}: strict load in speculators 0.9.0, its schema and forward agree "
      f"(held-back loss {eval_loss:.6f}, rel diff {best:.1e} over {len(losses)} samples)")
