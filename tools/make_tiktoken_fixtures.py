#!/usr/bin/env python3
"""Expected ids for tests/text/test_tiktoken.cpp: Meta's Llama-3 tiktoken `tokenizer.model`
(../shared/data/tokenizers/files/llama3_tiktoken/) must tokenize exactly as Hugging Face
`tokenizers` does with Meta's Llama-3 tokenizer.json. Deterministic; rerun to regenerate
tests/fixtures/tokenizers/tiktoken_llama3_cases.json:

    python3 tools/make_tiktoken_fixtures.py
    python3 tools/make_tiktoken_fixtures.py --reference-json HF_TOKENIZER_JSON OUT_JSON   # for tokenizer_parity.sh

The reference is ../shared/data/tokenizers/hf/llama3/tokenizer.json.gz (vocabulary, merges,
Split+ByteLevel pre-tokenizer: identical to what transformers' TikTokenConverter derives from the
tiktoken file). That copy has no added tokens and no TemplateProcessing, which Meta's published
meta-llama/Meta-Llama-3-8B tokenizer.json has, so they are added here as Meta defines them
(llama3/tokenizer.py): 256 special tokens at 128000.. and "<|begin_of_text|> $A".

Needs: tokenizers.
"""
import gzip
import json
import os
import sys

from tokenizers import AddedToken, Tokenizer, processors

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..")
HF_JSON_GZ = os.path.join(SRC, "..", "shared", "data", "tokenizers", "hf", "llama3", "tokenizer.json.gz")
OUT = os.path.join(SRC, "tests", "fixtures", "tokenizers", "tiktoken_llama3_cases.json")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
            "<|reserved_special_token_2|>", "<|reserved_special_token_3|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"] + \
           [f"<|reserved_special_token_{i}|>" for i in range(5, 251)]

CASES = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", " \n", "\r\n", "Hello world", " Hello world", "Hello  world  ",
    "Isn't it? We'll see, they'd say.", "THE QUICK 's 'S 'Ll 'VE", "12345 67 8 9", "0.5 3.14159 1,000,000",
    "def f(x):\n    return x * 2\n", "print(f(21))\t# tabs\r\n", "Ünïcödé façade naïve café",
    "e\u0301 combining", "東京 北京 こんにちは 안녕하세요", "Привет мир", "emoji 😀🎉👍🏽 ©®™ ½",
    "“quotes” ‘single’ — – …", "zzzz unseen qqqq xxyyzz", "Ω≈ç√∫˜µ≤≥÷", "a\u00a0b\u2003c\u3000d",
    "<|begin_of_text|>", "<|eot_id|>", "text<|eot_id|>more", "a <|end_of_text|> b",
    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
    "<|reserved_special_token_250|><|reserved_special_token_251|>", "<|eot_id", "<|begin_of_text|><|begin_of_text|>",
    "   leading and trailing   ", "a\n\n\n\nb", "!!!???...", "https://example.com/path?q=1&r=2#frag",
    "ดิฉันชื่อ", "مرحبا بالعالم", "नमस्ते दुनिया", "\u200b\u200d\ufeff", "🤷🏽‍♀️", "x" * 200,
    "1234567890123", "Ｆｕｌｌｗｉｄｔｈ", "tab\there", "\x00\x01\x7f",
]


def reference(hf_json_text):
    tok = Tokenizer.from_str(hf_json_text)
    assert tok.get_vocab_size(with_added_tokens=False) == 128000
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == 128000 + i, s
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 128000)]),
    ])
    return tok


def main():
    args = sys.argv[1:]
    if args[:1] == ["--reference-json"]:
        src, out = args[1], args[2]
        with open(src, encoding="utf-8") as f:
            reference(f.read()).save(out)
        return
    with gzip.open(HF_JSON_GZ, "rt", encoding="utf-8") as f:
        tok = reference(f.read())
    rows = []
    for t in CASES:
        for add in (False, True):
            ids = tok.encode(t, add_special_tokens=add).ids
            rows.append({"text": t, "add_special_tokens": add, "ids": ids,
                         "decoded": tok.decode(ids, skip_special_tokens=False),
                         "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(rows, f, ensure_ascii=False, indent=0)
        f.write("\n")
    print(f"wrote {OUT}: {len(rows)} cases")


if __name__ == "__main__":
    main()
