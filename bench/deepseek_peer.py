#!/usr/bin/env python3
"""The transformers peer of talon_bench_deepseek: the same Kimi-K2-shaped mini model
(hidden 7168, MLA with q LoRA 1536 / kv LoRA 512, 64 heads of 128 + 64, 384 routed experts
top-8 of width 2048 plus one shared expert, sigmoid noaux_tc routing, a dense first layer,
vocab 163840), random bf16 weights built on the GPU, run as the HF-backend extractors run it:
one forward with output_hidden_states over --seqs sequences of --seq-len random tokens, four
hidden states copied to the host. transformers has no int4 kernels for these experts, so
they are bf16 here: compare with `talon_bench_deepseek --bf16-experts` at the same --layers.

  python3 bench/deepseek_peer.py [--layers 3] [--seqs 4] [--seq-len 2048] [--steps 3]
         [--experts grouped_mm|eager]

Prints the build time, tokens/s and the achieved TFLOP/s on active parameters (same count as
talon_bench_deepseek: 2 FLOP per active weight per token).
"""
import argparse
import math
import time

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--experts", default="grouped_mm", help="transformers experts implementation")
    ap.add_argument("--attn", default="sdpa")
    a = ap.parse_args()
    cfg = DeepseekV3Config(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=a.layers, num_attention_heads=64, num_key_value_heads=64, n_shared_experts=1,
        n_routed_experts=384, num_experts_per_tok=8, n_group=1, topk_group=1, first_k_dense_replace=1,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        routed_scaling_factor=2.827, norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=262144,
        rope_parameters=dict(rope_theta=50000.0, rope_type="default"), tie_word_embeddings=False)
    cfg._attn_implementation = a.attn
    kwargs = {}
    if a.experts:
        kwargs["experts_implementation"] = a.experts
    t0 = time.time()
    torch.manual_seed(1)
    with torch.device("cuda"):
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, **kwargs)
        except (TypeError, ValueError) as e:
            print(f"experts_implementation={a.experts} not accepted ({e}); default implementation")
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    torch.cuda.synchronize()
    build = time.time() - t0
    H, nh = 7168.0, 64.0
    attn = H * 1536 + 1536 * nh * 192 + H * (512 + 64) + 512 * nh * 256 + nh * 128 * H
    moe, dense = 9 * 3 * H * 2048, 3 * H * 18432
    active = a.layers * attn + dense + (a.layers - 1) * moe
    print(f"transformers {__import__('transformers').__version__}, torch {torch.__version__}: Kimi-K2 shape, "
          f"{a.layers} layers (1 dense + {a.layers - 1} MoE, bf16 experts, {a.experts or 'default'} experts, "
          f"{a.attn}): build {build:.1f} s, GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB; "
          f"{active / 1e9:.2f}B active parameters per token")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.seqs, a.seq_len), generator=g).cuda()
    cap = [1, a.layers // 2, a.layers - 1, a.layers]

    def step():
        out = model.model(input_ids=ids, output_hidden_states=True)
        hs = out.hidden_states  # HF: [0] embeddings ... [L] after the final norm (shape check only)
        return [hs[i].to("cpu", non_blocking=False) for i in cap]

    with torch.inference_mode():
        step()
        torch.cuda.synchronize()
        peak0 = torch.cuda.max_memory_allocated()
        t = time.time()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        dt = (time.time() - t) / a.steps
    n = a.seqs * a.seq_len
    print(f"{n} tokens per forward: {dt * 1e3:.1f} ms, {n / dt:.0f} tokens/s, "
          f"{2 * active * n / dt / 1e12:.1f} TFLOP/s on active weights; peak memory {peak0 / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
