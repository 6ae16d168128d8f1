#!/usr/bin/env python3
"""Writes a random-weight HF checkpoint with real model shapes (bf16, sharded safetensors
+ index), for load and speed benchmarks. Needs only numpy; the safetensors container is
written directly (header JSON + raw little-endian bytes).

  tools/make_random_checkpoint.py --shape llama3-8b --out /tmp/rand-llama3-8b
"""
import argparse
import json
import os
import struct

import numpy as np

SHAPES = {
    # name: (model_type, L, H, I, heads, kv_heads, V, tied, rope)
    "llama3-8b": ("llama", 32, 4096, 14336, 32, 8, 128256, False,
                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "smollm2-135m": ("llama", 30, 576, 1536, 9, 3, 49152, True, {"rope_type": "default", "rope_theta": 100000.0}),
    "qwen3-8b": ("qwen3", 36, 4096, 12288, 32, 8, 151936, False, {"rope_type": "default", "rope_theta": 1000000.0}),
    "llama3-1b": ("llama", 16, 2048, 8192, 32, 8, 128256, True,
                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def tensors(model_type, L, H, I, nh, nkv, V, tied):
    hd = H // nh  # all shapes here have head_dim = hidden / heads (128 for the 8B ones)
    yield "model.embed_tokens.weight", (V, H)
    for l in range(L):
        p = f"model.layers.{l}."
        yield p + "input_layernorm.weight", (H,)
        yield p + "self_attn.q_proj.weight", (nh * hd, H)
        yield p + "self_attn.k_proj.weight", (nkv * hd, H)
        yield p + "self_attn.v_proj.weight", (nkv * hd, H)
        yield p + "self_attn.o_proj.weight", (H, nh * hd)
        if model_type == "qwen3":
            yield p + "self_attn.q_norm.weight", (hd,)
            yield p + "self_attn.k_norm.weight", (hd,)
        yield p + "post_attention_layernorm.weight", (H,)
        yield p + "mlp.gate_proj.weight", (I, H)
        yield p + "mlp.up_proj.weight", (I, H)
        yield p + "mlp.down_proj.weight", (H, I)
    yield "model.norm.weight", (H,)
    if not tied:
        yield "lm_head.weight", (V, H)


def bf16_random(shape, rng, norm):
    n = int(np.prod(shape))
    if norm:
        x = np.ones(n, np.float32)
    else:
        x = rng.standard_normal(n, dtype=np.float32)
        x *= 0.02
    return (x.view(np.uint32) >> 16).astype(np.uint16)


def write_shard(path, items):
    header, off = {}, 0
    for name, arr, shape in items:
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path + ".tmp", "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, arr, _ in items:
            arr.tofile(f)
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--shard-gb", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch", action="store_true", help="generate on a CUDA device with torch (much faster)")
    a = ap.parse_args()
    if a.torch:
        import torch
        gen = torch.Generator(device="cuda").manual_seed(a.seed)

        def fast(shape, rng, norm):
            if norm:
                t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
            else:
                t = (torch.randn(shape, generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
            return t.view(torch.int16).cpu().numpy().view(np.uint16).reshape(-1)
        global bf16_random
        bf16_random = fast
    mt, L, H, I, nh, nkv, V, tied, rope = SHAPES[a.shape]
    os.makedirs(a.out, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}[mt]
    cfg = {"architectures": [arch], "model_type": mt, "head_dim": H // nh, "num_hidden_layers": L, "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": nh, "num_key_value_heads": nkv, "vocab_size": V,
           "rms_norm_eps": 1e-6 if mt == "qwen3" else 1e-5, "tie_word_embeddings": tied, "max_position_embeddings": 131072,
           "rope_parameters": rope, "torch_dtype": "bfloat16"}
    json.dump(cfg, open(os.path.join(a.out, "config.json"), "w"), indent=2)
    rng = np.random.default_rng(a.seed)
    limit = int(a.shard_gb * 2**30)
    shards, cur, cur_bytes, wmap = [], [], 0, {}

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            shards.append(cur)
            cur, cur_bytes = [], 0

    specs = list(tensors(mt, L, H, I, nh, nkv, V, tied))
    total = sum(2 * int(np.prod(s)) for _, s in specs)
    n_shards_est = max(1, -(-total // limit))
    idx = 0
    for name, shape in specs:
        nbytes = 2 * int(np.prod(shape))
        if cur and cur_bytes + nbytes > limit:
            fn = f"model-{len(shards) + 1:05d}.safetensors"
            write_shard(os.path.join(a.out, fn), cur)
            for n_, _, _ in cur:
                wmap[n_] = fn
            flush()
        cur.append((name, bf16_random(shape, rng, name.endswith("norm.weight")), shape))
        cur_bytes += nbytes
    fn = f"model-{len(shards) + 1:05d}.safetensors"
    write_shard(os.path.join(a.out, fn), cur)
    for n_, _, _ in cur:
        wmap[n_] = fn
    flush()
    json.dump({"metadata": {"total_size": total}, "weight_map": wmap},
              open(os.path.join(a.out, "model.safetensors.index.json"), "w"), indent=1)
    print(f"{a.out}: {len(specs)} tensors, {total / 2**30:.2f} GiB in {len(shards)} shards")


if __name__ == "__main__":
    main()
