#!/usr/bin/env python3
"""Golden fixtures for the DeepSeek-V2/V3 (Kimi-K2) CPU reference: tiny random HF
checkpoints of transformers' DeepseekV2/DeepseekV3 models, and the hidden states and
logits transformers computes on them (fp32, eager attention).

  tests/fixtures/golden/<case>/  config.json, model.safetensors, golden.safetensors, golden.json

Same conventions as tools/make_golden.py (hidden.k = input of decoder layer k, hidden.L =
last layer output before the final norm). Quantized cases store their linear weights as
the real checkpoints do, and the golden comes from transformers run on the *dequantized*
weights (fp32), so Talon's dequantizer and forward are checked together:

  fp8   DeepSeek-V3 official: `.weight` F8_E4M3 + `.weight_scale_inv` fp32 per block
        (block 16x16 here so the tiny matrices have several, partial, blocks; the real
        checkpoints use 128x128 — the block comes from quantization_config).
  int4  compressed-tensors pack-quantized W4A16 as Kimi-K2-Thinking ships its experts:
        `.weight_packed` int32 [O, I/8] (8 values per word, low nibble first, each stored
        as q + 8), `.weight_scale` bf16 [O, I/32], `.weight_shape` int64 [2]. Packed here
        from scratch with the documented layout (compressed_tensors is not installed).

Routing is discrete: a near-tie in the top-k choice could flip between implementations
on rounding alone, so every case checks that each router decision (group choice, expert
choice) has a margin of at least MIN_MARGIN and fails otherwise.

A case may ask for a larger margin ("bf16_margin" in its options): seeds are tried in order
from the case's base seed until the smallest routing gap reaches it, so a bf16 implementation
(the CUDA model) is not judged on an expert choice that bf16 rounding alone can flip.

Usage: python tools/make_golden_deepseek.py [case ...]   (no case: all of them)
"""

import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV2Config, DeepseekV3Config

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_golden import CONVENTION, GOLDEN_DIR, SEED, run_with_hidden  # noqa: E402

MIN_MARGIN = 1e-4
FP8_BLOCK = 16
INT4_GROUP = 32

YARN_V3 = dict(rope_theta=10000.0, rope_type="yarn", factor=4.0, original_max_position_embeddings=16,
               beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8)
YARN_V2 = dict(rope_theta=10000.0, rope_type="yarn", factor=8.0, original_max_position_embeddings=8,
               beta_fast=32, beta_slow=1, mscale=0.707, mscale_all_dim=0.707)


def cases():
    """name -> (config class, kwargs, storage, T, options)."""
    common_v3 = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                     n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                     first_k_dense_replace=1, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                     v_head_dim=12, routed_scaling_factor=2.5, norm_topk_prob=True,
                     rms_norm_eps=1e-6, tie_word_embeddings=False)
    return {
        # q LoRA, YaRN with mscale != mscale_all_dim (both the cos/sin factor and the
        # softmax-scale correction are exercised), sigmoid + noaux_tc with a bias.
        # rms_norm_eps 1e-5 here (q_a_layernorm / kv_a_layernorm keep transformers' default
        # 1e-6; with O(1) latents the golden cannot tell the two eps apart, though).
        # Its first seed's smallest routing gap (1.7e-3) was within bf16 noise: the CUDA model,
        # like transformers in bf16, flipped an expert choice. bf16_margin asks for 1e-2.
        "deepseek_v3": (DeepseekV3Config, dict(common_v3, q_lora_rank=24, n_shared_experts=1, rms_norm_eps=1e-5,
                                               rope_parameters=YARN_V3), "f32", 13, {"bf16_margin": 1e-2}),
        # plain q_proj, rotate_half RoPE (rope_interleave false), 2 shared experts, bf16.
        "deepseek_v3_noqlora": (DeepseekV3Config, dict(
            common_v3, q_lora_rank=None, n_shared_experts=2, rope_interleave=False,
            rope_parameters=dict(rope_theta=10000.0, rope_type="default")), "bf16", 11, {}),
        # DeepSeek-V2-Lite style: softmax scoring, group_limited_greedy, no top-k norm,
        # plain q, YaRN with mscale == mscale_all_dim.
        "deepseek_v2": (DeepseekV2Config, dict(
            vocab_size=80, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
            topk_method="group_limited_greedy", first_k_dense_replace=1, n_shared_experts=2,
            kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
            routed_scaling_factor=1.5, norm_topk_prob=False, rope_parameters=YARN_V2,
            rms_norm_eps=1e-6, tie_word_embeddings=False), "f32", 12, {}),
        # V2 greedy top-k with q LoRA, every layer MoE, tied embeddings.
        "deepseek_v2_greedy": (DeepseekV2Config, dict(
            vocab_size=72, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            n_routed_experts=6, num_experts_per_tok=2, topk_method="greedy", first_k_dense_replace=0,
            n_shared_experts=1, kv_lora_rank=16, q_lora_rank=20, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=8, routed_scaling_factor=1.0, norm_topk_prob=False,
            rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
            rms_norm_eps=1e-6, tie_word_embeddings=True), "f32", 9, {}),
        # DeepSeek-V3 official FP8 block quantization of every linear layer but the router.
        "deepseek_v3_fp8": (DeepseekV3Config, dict(
            common_v3, hidden_size=40, intermediate_size=56, moe_intermediate_size=24, q_lora_rank=24,
            n_shared_experts=1, rope_parameters=YARN_V3), "fp8", 12, {}),
        # Kimi-K2-Thinking style: model_type kimi_k2, int4 group-32 experts, bf16 rest.
        "kimi_k2_int4": (DeepseekV3Config, dict(
            common_v3, hidden_size=64, intermediate_size=48, moe_intermediate_size=32, q_lora_rank=24,
            n_shared_experts=1, rope_parameters=dict(rope_theta=50000.0, rope_type="default")),
            "int4", 12, {"model_type": "kimi_k2"}),
    }


@torch.no_grad()
def init_weights(model, gen):
    for name, p in model.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith("mlp.gate.weight"):  # router: spread logits so routing varies
            p.copy_(0.4 * torch.randn(p.shape, generator=gen))
        else:
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))


def router_margins(model, input_ids, cfg):
    """Smallest gap of any routing decision (group top-k, expert top-k) in the forward."""
    inputs, handles = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            handles.append(layer.mlp.gate.register_forward_hook(
                lambda m, a, o: inputs.append((m, a[0].detach().reshape(-1, a[0].shape[-1])))))
    with torch.no_grad():
        model(input_ids=input_ids.view(1, -1), use_cache=False)
    for h in handles:
        h.remove()
    worst = float("inf")
    v3 = isinstance(cfg, DeepseekV3Config)
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for gate, x in inputs:
        logits = x.float() @ gate.weight.float().t()
        if v3:
            choice = logits.sigmoid() + gate.e_score_correction_bias
            method = "noaux_tc"
        else:
            choice = logits.softmax(-1)
            method = cfg.topk_method
        G = cfg.n_group or 1
        if method != "greedy":
            grp = choice.view(-1, G, E // G)
            gs = grp.topk(2, -1)[0].sum(-1) if method == "noaux_tc" else grp.max(-1).values
            srt = gs.sort(-1, descending=True).values
            worst = min(worst, (srt[:, cfg.topk_group - 1] - srt[:, cfg.topk_group]).min().item())
            keep = torch.zeros_like(gs).scatter_(1, gs.topk(cfg.topk_group, -1)[1], 1.0)
            mask = keep.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
            choice = choice.masked_fill(~mask, float("-inf"))
        srt = choice.sort(-1, descending=True).values
        worst = min(worst, (srt[:, k - 1] - srt[:, k]).min().item())
    return worst


def is_linear(name):
    return name.endswith("_proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


def fp8_quantize(w):
    """Block FP8 as DeepSeek-V3 ships it: per FP8_BLOCK^2 block, scale_inv = amax / 448."""
    O, I = w.shape
    so, si = -(-O // FP8_BLOCK), -(-I // FP8_BLOCK)
    scale = torch.empty(so, si)
    q = torch.empty(O, I, dtype=torch.float8_e4m3fn)
    deq = torch.empty(O, I)
    for a in range(so):
        for b in range(si):
            blk = w[a * FP8_BLOCK:(a + 1) * FP8_BLOCK, b * FP8_BLOCK:(b + 1) * FP8_BLOCK]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            qb = (blk / s).to(torch.float8_e4m3fn)
            scale[a, b] = s
            q[a * FP8_BLOCK:(a + 1) * FP8_BLOCK, b * FP8_BLOCK:(b + 1) * FP8_BLOCK] = qb
            deq[a * FP8_BLOCK:(a + 1) * FP8_BLOCK, b * FP8_BLOCK:(b + 1) * FP8_BLOCK] = qb.float() * s
    return q, scale.float(), deq


def int4_pack(q):
    """q int [O, I] in [-8, 7] -> int32 [O, ceil(I/8)]: element 8j+k in bits 4k..4k+3, as q + 8."""
    O, I = q.shape
    words = -(-I // 8)
    u = torch.zeros(O, words * 8, dtype=torch.int64)
    u[:, :I] = q.to(torch.int64) + 8
    packed = torch.zeros(O, words, dtype=torch.int64)
    for k in range(8):
        packed |= u[:, k::8] << (4 * k)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as int32
    return packed.to(torch.int32)


def int4_quantize(w):
    """Symmetric group-wise int4: scale (bf16) = amax / 7.5 per INT4_GROUP columns."""
    O, I = w.shape
    assert I % INT4_GROUP == 0
    g = w.view(O, I // INT4_GROUP, INT4_GROUP)
    scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)
    q = torch.clamp(torch.round(g / scale.float().unsqueeze(-1)), -8, 7)
    deq = (q * scale.float().unsqueeze(-1)).view(O, I)
    return int4_pack(q.view(O, I).to(torch.int8)), scale, deq


def make_case(ci, name, cfg_cls, kw, storage, T, opts):
    """Writes the case; returns its smallest routing margin."""
    seed = SEED + 7000 + 1000 * ci + opts.get("seed_offset", 0)
    gen = torch.Generator().manual_seed(seed)
    cfg = cfg_cls(max_position_embeddings=64, hidden_act="silu", bos_token_id=1, eos_token_id=2,
                  pad_token_id=None, **kw)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    init_weights(model, gen)
    d = os.path.join(GOLDEN_DIR, name)
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    # save_pretrained writes the HF checkpoint layout (per-expert tensors); re-read it.
    model.save_pretrained(d)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(d, extra)):
            os.remove(os.path.join(d, extra))
    from safetensors.torch import load_file
    sd = load_file(os.path.join(d, "model.safetensors"))
    out, golden_sd, quantized = {}, {}, []
    for n, t in sd.items():
        t = t.float()
        if storage == "bf16":
            t = t.to(torch.bfloat16)
            out[n] = t
            golden_sd[n] = t.float()
        elif storage == "fp8" and is_linear(n):
            q, s, deq = fp8_quantize(t)
            out[n] = q
            out[n + "_scale_inv"] = s
            golden_sd[n] = deq
            quantized.append(n)
        elif storage == "int4" and ".mlp.experts." in n:
            base = n[:-len(".weight")]
            packed, s, deq = int4_quantize(t)
            out[base + ".weight_packed"] = packed
            out[base + ".weight_scale"] = s
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int64)
            golden_sd[n] = deq
            quantized.append(n)
        elif storage == "int4":
            out[n] = t.to(torch.bfloat16)
            golden_sd[n] = out[n].float()
        else:
            out[n] = t
            golden_sd[n] = t
    os.remove(os.path.join(d, "model.safetensors"))
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(d, "model.safetensors"),
              metadata={"format": "pt"})
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cj = json.load(f)
    if storage == "fp8":
        cj["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
    if storage == "int4":
        cj["quantization_config"] = {
            "config_groups": {"group_0": {"input_activations": None, "output_activations": None,
                                          "targets": ["Linear"],
                                          "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                                      "group_size": INT4_GROUP, "num_bits": 4,
                                                      "observer": "minmax", "observer_kwargs": {},
                                                      "strategy": "group", "symmetric": True, "type": "int"}}},
            "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                                    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}
    if "model_type" in opts:
        cj["model_type"] = opts["model_type"]
    with open(cfg_path, "w") as f:
        json.dump(cj, f, indent=2, sort_keys=True)
        f.write("\n")

    # The golden: transformers on exactly the (dequantized) weights the checkpoint holds,
    # loaded through from_pretrained (which maps the per-expert tensors onto its fused ones).
    del model
    tmp = os.path.join(d, "_ref")
    os.makedirs(tmp)
    save_file({k: v.contiguous() for k, v in golden_sd.items()}, os.path.join(tmp, "model.safetensors"),
              metadata={"format": "pt"})
    cfg.save_pretrained(tmp)
    reloaded, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager",
                                                          output_loading_info=True)
    reloaded.eval()
    shutil.rmtree(tmp)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    input_ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, dtype=torch.long)
    hidden, logits, diffs = run_with_hidden(reloaded, input_ids)
    margin = router_margins(reloaded, input_ids, cfg)
    assert margin > MIN_MARGIN, f"{name}: routing margin {margin} too small; change the seed"

    tensors = {"input_ids": input_ids.contiguous(), "logits": logits}
    for k, h in enumerate(hidden):
        tensors[f"hidden.{k}"] = h
    save_file(tensors, os.path.join(d, "golden.safetensors"), metadata={"convention": CONVENTION})
    meta = {
        "case": name, "architecture": cj["architectures"][0], "model_type": cj["model_type"],
        "L": cfg.num_hidden_layers, "H": cfg.hidden_size, "T": T, "V": cfg.vocab_size,
        "storage": storage, "quantized_tensors": len(quantized),
        "golden_dtype": "float32", "golden_from": "transformers eager fp32 on the dequantized weights",
        "min_routing_margin": margin, "seed": seed,
        "transformers_version": transformers.__version__, "torch_version": torch.__version__,
        "convention": CONVENTION, "tensors": sorted(tensors), "files": sorted(os.listdir(d)),
        "checks": diffs,
    }
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    print(f"[deepseek] {name}: storage={storage} quantized={len(quantized)} margin={margin:.3g} "
          f"bytes={size} |logits|max={logits.abs().max().item():.3g}")
    return margin


def make_quant_known():
    """tests/fixtures/quant/known.safetensors: dequantizer test vectors computed by torch.

    fp8_codes     F8_E4M3 [256]  every byte value; fp8_values F32 [256] = torch's float of each
    fp8_w         F8_E4M3 [20, 36] with fp8_scale_inv F32 [2, 3] (block 16: partial blocks)
    fp8_deq       F32 [20, 36] = fp8_w.float() * scale_inv per block
    int4_packed   I32 [5, 5] (I = 40, group 16: the last group partial), int4_scale BF16 [5, 3]
    int4_q        I8 [5, 40] the signed values packed, int4_deq F32 [5, 40]
    """
    gen = torch.Generator().manual_seed(SEED + 99)
    out = {}
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    out["fp8_codes"] = codes.view(torch.float8_e4m3fn)
    out["fp8_values"] = out["fp8_codes"].float()
    w = torch.randn(20, 36, generator=gen) * 3
    blk = 16
    q = torch.empty(20, 36, dtype=torch.float8_e4m3fn)
    scale = torch.empty(2, 3)
    deq = torch.empty(20, 36)
    for a in range(2):
        for b in range(3):
            sl = (slice(a * blk, (a + 1) * blk), slice(b * blk, (b + 1) * blk))
            s = w[sl].abs().max() / 448.0
            scale[a, b] = s
            q[sl] = (w[sl] / s).to(torch.float8_e4m3fn)
            deq[sl] = q[sl].float() * s
    out.update(fp8_w=q, fp8_scale_inv=scale, fp8_deq=deq)
    qi = torch.randint(-8, 8, (5, 40), generator=gen).to(torch.int8)
    si = (torch.rand(5, 3, generator=gen) + 0.1).to(torch.bfloat16)
    group = 16
    deq4 = qi.float() * si.float().repeat_interleave(group, dim=1)[:, :40]
    out.update(int4_packed=int4_pack(qi), int4_scale=si, int4_q=qi, int4_deq=deq4)
    d = os.path.join(GOLDEN_DIR, "..", "quant")
    os.makedirs(d, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(d, "known.safetensors"))
    print(f"[quant] {os.path.normpath(d)}/known.safetensors")


def main():
    torch.set_grad_enabled(False)
    only = set(sys.argv[1:])
    if not only:
        make_quant_known()
    for ci, (name, (cls, kw, storage, T, opts)) in enumerate(cases().items()):
        if only and name not in only:
            continue
        need = opts.get("bf16_margin", 0.0)
        for offset in range(200):
            if make_case(ci, name, cls, kw, storage, T, dict(opts, seed_offset=offset)) >= need:
                break
        else:
            raise SystemExit(f"{name}: no seed in 200 gives a routing margin of {need}")


if __name__ == "__main__":
    main()
