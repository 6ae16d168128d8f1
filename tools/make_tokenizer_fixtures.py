#!/usr/bin/env python3
"""Small synthetic tokenizer.json fixtures for tests/text/test_tokenizer.cpp, with the expected
ids and decodes computed by Hugging Face `tokenizers` (the oracle). Deterministic; rerun to
regenerate tests/fixtures/tokenizers/:

    python3 tools/make_tokenizer_fixtures.py

Needs: tokenizers.
"""
import json
import os

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "tokenizers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Isn't it? We'll see, they'd say.",
    "Hello world! hello World!! 12345 67 8 9 0.5 3.14159",
    "def f(x):\n    return x * 2\n\n\nprint(f(21))\t# tabs\r\n",
    "Ünïcödé façade naïve café 東京 北京 こんにちは 안녕하세요 Привет мир",
    "emoji 😀🎉👍🏽 and symbols ©®™ ½ ¼ — – … “quotes” ‘single’",
] * 20

CASES = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "Hello world", " Hello world", "Hello  world  ",
    "Isn't it? We'll see, they'd say.", "THE QUICK 's 'S 'Ll", "12345 67 8 9", "0.5 3.14159 1,000,000",
    "def f(x):\n    return x * 2\n", "print(f(21))\t# tabs\r\n", "Ünïcödé façade naïve café",
    "e\u0301 combining then NFC", "東京 北京 こんにちは 안녕하세요", "Привет мир", "emoji 😀🎉👍🏽 ©®™ ½",
    "“quotes” ‘single’ — – …", "zzzz unseen qqqq xxyyzz", "Ω≈ç√∫˜µ≤≥÷", "a\u00a0b\u2003c\u3000d",
    "<|end|>", "text<|end|>more", "a <|end|> b", "<|end|><|end|>", "<|end", "hi <think>x</think> hi",
    "x<think>y", "wordhello hello helloword", " hello world", "\u2581already\u2581meta", "tab\there",
]


def bytelevel_tiny():
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
                             behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_special_tokens([AddedToken("<|end|>", special=True, normalized=False), "<|begin|>"])
    tok.add_tokens([AddedToken("<think>", lstrip=True, normalized=False),
                    AddedToken("</think>", rstrip=True, normalized=False),
                    AddedToken("hello", single_word=True, normalized=True)])
    begin = tok.token_to_id("<|begin|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin|> $A", special_tokens=[("<|begin|>", begin)])
    return tok


def spm_tiny():
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=300, min_frequency=2, show_progress=False,
                                  special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=60)
    tok.train_from_iterator(CORPUS, trainer)
    j = json.loads(tok.to_str())
    vocab = j["model"]["vocab"]
    for b in range(256):  # byte-fallback pieces, as SentencePiece vocabularies have
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    j["post_processor"] = {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                           "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [vocab["<s>"]], "tokens": ["<s>"]}}}
    return Tokenizer.from_str(json.dumps(j))


def spm_legacy_tiny(base):
    j = json.loads(base.to_str())
    j["pre_tokenizer"] = None
    j["normalizer"] = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                                                          {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]}
    return Tokenizer.from_str(json.dumps(j))


def main():
    os.makedirs(OUT, exist_ok=True)
    bl = bytelevel_tiny()
    sp = spm_tiny()
    tokenizers = {"bytelevel_tiny.json": bl, "spm_tiny.json": sp, "spm_legacy_tiny.json": spm_legacy_tiny(sp)}
    cases = {}
    for name, tok in tokenizers.items():
        tok.save(os.path.join(OUT, name), pretty=False)
        tok = Tokenizer.from_file(os.path.join(OUT, name))
        rows = []
        for text in CASES:
            for add in (False, True):
                ids = tok.encode(text, add_special_tokens=add).ids
                rows.append({"text": text, "add_special_tokens": add, "ids": ids,
                             "decoded": tok.decode(ids, skip_special_tokens=False),
                             "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
        cases[name] = rows
    with open(os.path.join(OUT, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, indent=0)
    # from_utf8_lossy oracle: Python's errors="replace" follows the same maximal-subpart rule.
    bad = [b"a\xffb", b"\xe2\x82a", b"\xed\xa0\x80x", b"\xf0\x9f\x98", b"\xc0\xaf", b"\xf4\x90\x80\x80", b"ok\xe2\x82\xac"]
    with open(os.path.join(OUT, "lossy.json"), "w", encoding="utf-8") as f:
        json.dump([{"hex": b.hex(), "text": b.decode("utf-8", errors="replace")} for b in bad], f, ensure_ascii=False)


if __name__ == "__main__":
    main()
