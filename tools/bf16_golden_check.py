#!/usr/bin/env python3
"""How far transformers itself lands from the fp32 goldens when run in bf16, on the plain and
FP8 DeepSeek-family fixtures (FP8 dequantized here): a yardstick for the CUDA model's bf16
tolerance.
  python3 tools/bf16_golden_check.py [--record] deepseek_v2 deepseek_v3 ...   (from the repository root)
Prints the per-layer and logit errors as the tests measure them (max |diff| / max(1, max |ref|)).
--record writes the bf16 errors into each fixture's golden.json ("transformers_bf16_err"): the
CUDA golden test allows a fixture's logits to be off by up to 1.5x what transformers itself
gets in bf16 when that is more than its fixed tolerance."""
import json, os, shutil, sys, torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoConfig
G = "tests/fixtures/golden"
def relerr(a, b):
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())
record = "--record" in sys.argv
for name in [a for a in sys.argv[1:] if a != "--record"]:
    d = os.path.join(G, name)
    cj = json.load(open(os.path.join(d, "config.json")))
    qc = cj.pop("quantization_config", None) or {}
    if qc and qc.get("quant_method") != "fp8":
        print(name, ": int4 fixture skipped"); continue
    sd = load_file(os.path.join(d, "model.safetensors"))
    out = {}
    for k, t in sd.items():  # FP8 block weights dequantized (w = q * scale_inv per block)
        if k.endswith("_scale_inv"):
            continue
        w = t.float()
        if k + "_scale_inv" in sd:
            bo, bi = qc["weight_block_size"]
            s = sd[k + "_scale_inv"].float()
            w = w * s.repeat_interleave(bo, 0)[: w.shape[0]].repeat_interleave(bi, 1)[:, : w.shape[1]]
        out[k] = w
    tmp = os.path.join(os.environ.get("TMPDIR", "/tmp"), "talon_bf16_ref_" + name)
    shutil.rmtree(tmp, ignore_errors=True); os.makedirs(tmp)
    json.dump(cj, open(os.path.join(tmp, "config.json"), "w"))
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    g = load_file(os.path.join(d, "golden.safetensors"))
    ids = g["input_ids"].long()[None]
    for dt in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(tmp, dtype=dt, attn_implementation="eager").eval()
        with torch.no_grad():
            o = m(ids, output_hidden_states=True)
        lg = o.logits[0].float()
        hs = [h[0].float() for h in o.hidden_states]
        # transformers' last hidden state is after the final norm; compare h[0..L-1] only.
        he = " ".join(f"{relerr(hs[k], g[f'hidden.{k}']):.4f}" for k in range(len(hs) - 1))
        shutil.rmtree(tmp, ignore_errors=True) if dt == torch.bfloat16 else None
        print(f"{name} {str(dt):15s} hidden {he} logits {relerr(lg, g['logits']):.4f} max|logit| {g['logits'].abs().max():.2f}")
        if record and dt == torch.bfloat16:
            gj_path = os.path.join(d, "golden.json")
            gj = json.load(open(gj_path))
            gj["transformers_bf16_err"] = {
                "hidden": [relerr(hs[k], g[f"hidden.{k}"]) for k in range(len(hs) - 1)],
                "logits": relerr(lg, g["logits"]), "device": "cpu", "torch_version": torch.__version__,
                "transformers_version": __import__("transformers").__version__}
            with open(gj_path, "w") as f:
                json.dump(gj, f, indent=2)
                f.write("\n")
