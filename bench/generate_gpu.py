#!/usr/bin/env python3
"""The transformers peer for `talon generate` throughput on one GPU (bf16, greedy, KV cache).

  python3 bench/generate_gpu.py --gguf SmolLM2.gguf --data a.jsonl b.jsonl --batches 1,32,256
  python3 bench/generate_gpu.py --random8b --context 512 --batches 1,32,256

With --gguf: the first turn of each question, rendered with the model's chat template,
batched in input order (left padding), max_new_tokens per sequence, generation stopping at
eos; tokens/s counts generated tokens up to and including eos (padding after a finished
sequence is not counted). With --random8b: a Llama-3.1-8B-shaped model with random bf16
weights, random prompts of --context tokens, exactly --new-tokens per sequence.
Prints one JSON line per batch size."""
import argparse, json, os, sys, time

import torch


def first_turn(rec):
    for k in ("turns",):
        if k in rec and rec[k]:
            return rec[k][0]
    for k in ("prompt", "question", "instruction"):
        if k in rec:
            return rec[k]
    raise ValueError(f"no prompt in {list(rec)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf")
    ap.add_argument("--random8b", action="store_true")
    ap.add_argument("--data", nargs="*", default=[])
    ap.add_argument("--batches", default="1,32,256")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--limit1", type=int, default=8, help="prompts at batch 1")
    a = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    dev = "cuda"
    if a.random8b:
        cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                          num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
        torch.manual_seed(0)
        with torch.device(dev):
            m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        m.eval()
        for b in map(int, a.batches.split(",")):
            ids = torch.randint(0, cfg.vocab_size, (b, a.context), device=dev)
            m.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens,
                       min_new_tokens=a.new_tokens, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(json.dumps({"peer": "transformers", "model": "random-llama3-8b", "batch": b, "context": a.context,
                              "new_tokens": a.new_tokens, "seconds": dt, "tokens_per_s": b * a.new_tokens / dt,
                              "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
        return
    d, f = os.path.split(os.path.abspath(a.gguf))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).to(torch.bfloat16).to(dev)
    m.eval()
    prompts = []
    for p in a.data:
        for line in open(p):
            if line.strip():
                prompts.append(tok.apply_chat_template([{"role": "user", "content": first_turn(json.loads(line))}],
                                                       tokenize=False, add_generation_prompt=True))
    eos = tok.eos_token_id
    for b in map(int, a.batches.split(",")):
        ps = prompts[: a.limit1] if b == 1 else prompts[: max(b, (len(prompts) // b) * b)]
        gen = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, len(ps), b):
            enc = tok(ps[i:i + b], return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
            out = m.generate(**enc, max_new_tokens=a.new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
            new = out[:, enc["input_ids"].shape[1]:].tolist()
            for row in new:
                n = len(row)
                if eos in row:
                    n = row.index(eos) + 1
                gen += n
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        print(json.dumps({"peer": "transformers", "model": "SmolLM2-135M-Instruct (GGUF, bf16)", "batch": b,
                          "prompts": len(ps), "new_tokens": gen, "seconds": dt, "tokens_per_s": gen / dt}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
