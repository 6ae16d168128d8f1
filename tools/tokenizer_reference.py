#!/usr/bin/env python3
"""Hugging Face reference ids for `talon tokenize` parity tests.

    tokenizer_reference.py TOKENIZER INPUT.jsonl OUTPUT.jsonl [--export-json PATH] [--sentencepiece]

TOKENIZER is a tokenizer.json (or a directory holding one), a .gguf (loaded the way transformers
does: AutoTokenizer.from_pretrained(dir, gguf_file=...)), or a SentencePiece model (converted the
way transformers does: LlamaTokenizer.from_pretrained on a directory holding it as
tokenizer.model). INPUT lines are {"text": ...} (optionally "add_special_tokens": bool, default
true); OUTPUT lines are {"ids": [...], "decoded": decode(ids, skip_special_tokens=False)}.
--export-json writes the HF tokenizer.json that was used. --sentencepiece uses the
`sentencepiece` package instead (the oracle for .model files: SentencePiece's own score-based BPE,
with unknown/control/user-defined pieces matched whole first as HF added tokens are; this equals
Meta's Llama-2 tokenizer.json and llama.cpp's llama-spm pairs; add_special_tokens is ignored).

Needs: tokenizers; transformers (+ gguf for .gguf; sentencepiece + protobuf for .model).
"""
import json
import os
import shutil
import sys
import tempfile


def load_hf(path):
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "tokenizer.json")):
        path = os.path.join(path, "tokenizer.json")
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"GGUF":
        from transformers import AutoTokenizer
        t = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
        return t.backend_tokenizer
    if head.lstrip()[:1] == b"{":
        from tokenizers import Tokenizer
        return Tokenizer.from_file(path)
    # SentencePiece ModelProto: convert as transformers does.
    from transformers import LlamaTokenizer
    d = tempfile.mkdtemp()
    try:
        shutil.copy(path, os.path.join(d, "tokenizer.model"))
        return LlamaTokenizer.from_pretrained(d).backend_tokenizer
    finally:
        shutil.rmtree(d)


def main():
    args = sys.argv[1:]
    export = None
    raw_spm = False
    if "--export-json" in args:
        i = args.index("--export-json")
        export = args[i + 1]
        del args[i:i + 2]
    if "--sentencepiece" in args:
        args.remove("--sentencepiece")
        raw_spm = True
    if len(args) != 3:
        sys.exit(__doc__)
    tok_path, inp, outp = args
    rows = [json.loads(l) for l in open(inp, encoding="utf-8") if l.strip()]
    with open(outp, "w", encoding="utf-8") as out:
        if raw_spm:
            import sentencepiece as spm
            import re
            from tokenizers import decoders
            sp = spm.SentencePieceProcessor(model_file=tok_path)
            dec = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
            # Unknown/control pieces are matched whole in the text first (as HF's
            # added tokens and Meta's Llama-2 tokenizer.json do); sentencepiece encodes the rest.
            added = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())
                     if sp.is_unknown(i) or sp.is_control(i)}
            added = {k: v for k, v in added.items() if k}
            pat = re.compile("|".join(re.escape(k) for k in sorted(added, key=len, reverse=True))) if added else None
            for r in rows:
                ids, pos, text = [], 0, r["text"]
                for m in (pat.finditer(text) if pat else []):
                    if m.start() > pos:
                        ids += sp.encode(text[pos:m.start()])
                    ids.append(added[m.group(0)])
                    pos = m.end()
                if pos < len(text):
                    ids += sp.encode(text[pos:])
                # Decode as HF's Llama decoder chain does (control pieces kept as text).
                pieces = [sp.id_to_piece(i) for i in ids]
                out.write(json.dumps({"ids": ids, "decoded": dec.decode(pieces)}, ensure_ascii=False) + "\n")
            return
        tok = load_hf(tok_path)
        if export:
            tok.save(export)
        texts = [r["text"] for r in rows]
        specials = [r.get("add_special_tokens", True) for r in rows]
        if all(specials) or not any(specials):
            encs = tok.encode_batch_fast(texts, add_special_tokens=specials[0] if specials else True) \
                if hasattr(tok, "encode_batch_fast") else tok.encode_batch(texts, add_special_tokens=specials[0] if specials else True)
        else:
            encs = [tok.encode(t, add_special_tokens=s) for t, s in zip(texts, specials)]
        for e in encs:
            ids = e.ids
            out.write(json.dumps({"ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False)},
                                 ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
