#!/usr/bin/env python3
"""Checks a `talon export` directory against the `talon train` checkpoint it came from,
reading both with the `safetensors` package and json only (no Talon code).

usage: check_export.py CHECKPOINT EXPORT_DIR speculators|sglang fp32|bf16 SPECULATIVE_TOKENS

Checks: the exact tensor set with 2-D [out, in] shapes; every weight bit-exact (fp32) or
equal to torch's bf16 rounding of the checkpoint (bf16); d2t/t2d equal and consistent;
config keys and aux layer ids in the engine's convention (vLLM: Talon's input-of-layer
ids as is; SGLang: minus 1, under eagle_config).
"""
import json
import sys

from safetensors.torch import load_file

from export_checks import check_tensors, read_checkpoint

ckpt_path, out_dir, fmt, dtype, spec_tokens = sys.argv[1:6]
spec_tokens = int(spec_tokens)

meta, ckpt = read_checkpoint(ckpt_path)
d = meta["draft"]
H, I, V, Vd = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["draft_vocab_size"]
qd, kvd = d["num_attention_heads"] * d["head_dim"], d["num_key_value_heads"] * d["head_dim"]
aux = meta["aux_layer_ids"]

prefix = "layers.0." if fmt == "speculators" else "midlayer."
# trainer name -> (engine name, shape)
table = {
    "fc": ("fc.weight", [H, 3 * H]),
    "in_ln": (prefix + "input_layernorm.weight", [H]),
    "hidden_norm": (prefix + "hidden_norm.weight", [H]),
    "wq": (prefix + "self_attn.q_proj.weight", [qd, 2 * H]),
    "wk": (prefix + "self_attn.k_proj.weight", [kvd, 2 * H]),
    "wv": (prefix + "self_attn.v_proj.weight", [kvd, 2 * H]),
    "wo": (prefix + "self_attn.o_proj.weight", [H, qd]),
    "post_ln": (prefix + "post_attention_layernorm.weight", [H]),
    "gate": (prefix + "mlp.gate_proj.weight", [I, H]),
    "up": (prefix + "mlp.up_proj.weight", [I, H]),
    "down": (prefix + "mlp.down_proj.weight", [H, I]),
    "norm": ("norm.weight", [H]),
    "lm_head": ("lm_head.weight", [Vd, H]),
}

out = load_file(f"{out_dir}/model.safetensors")
check_tensors(out, ckpt, table, dtype)
assert list(out["d2t"].shape) == [Vd] and list(out["t2d"].shape) == [V], (out["d2t"].shape, out["t2d"].shape)

cfg = json.load(open(f"{out_dir}/config.json"))
want_torch_dtype = "float32" if dtype == "fp32" else "bfloat16"
if fmt == "speculators":
    assert cfg["architectures"] == ["Eagle3Speculator"], cfg["architectures"]
    assert cfg["speculators_model_type"] == "eagle3"
    assert isinstance(cfg["speculators_version"], str)
    assert cfg["draft_vocab_size"] == Vd
    assert cfg["norm_before_residual"] is d["norm_before_residual"]
    assert cfg["target_hidden_size"] == H
    assert cfg["eagle_aux_hidden_state_layer_ids"] == aux, (cfg["eagle_aux_hidden_state_layer_ids"], aux)
    layer = cfg["transformer_layer_config"]
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["proposal_type"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == spec_tokens
    assert isinstance(sc["verifier"]["name_or_path"], str) and sc["verifier"]["architectures"]
else:
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"], cfg["architectures"]
    assert "speculators_model_type" not in cfg
    assert cfg["draft_vocab_size"] == Vd
    assert cfg["tie_word_embeddings"] is False
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [a - 1 for a in aux]
    layer = cfg
assert layer["num_hidden_layers"] == 1
assert layer["vocab_size"] == V
assert layer["hidden_size"] == H and layer["intermediate_size"] == I
assert layer["num_attention_heads"] == d["num_attention_heads"]
assert layer["num_key_value_heads"] == d["num_key_value_heads"]
assert layer["head_dim"] == d["head_dim"]
assert layer["rms_norm_eps"] == d["rms_norm_eps"]
assert isinstance(layer["rope_theta"], float) and layer["rope_theta"] > 0
assert "rope_scaling" in layer
assert layer["torch_dtype"] == want_torch_dtype
print(f"{fmt} {dtype}: {len(out)} tensors match the checkpoint")
