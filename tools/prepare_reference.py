#!/usr/bin/env python3
"""Independent oracle for `talon prepare`: expected input_ids and loss masks from transformers.

For each conversation ({"id", "messages"} JSONL) this computes, with transformers only:
  text    = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
  ids     = tok(text, add_special_tokens=False, return_offsets_mapping=True)   (HF offsets, chars)
  spans   : for each assistant turn i
              end   = len(apply_chat_template(messages[:i+1])), minus trailing whitespace
                      (must be a prefix of text)
              begin = len(apply_chat_template(messages[:i], add_generation_prompt=True)) when that
                      renders and is a prefix of the turn's rendering; otherwise (assistant-first
                      conversations) the common prefix of two renderings of messages[:i+1] whose
                      turn-i content is replaced by two different probe strings
  mask[k] = 1 iff token k's (non-empty) HF offset range overlaps a span.
The rule is the one docs/tokens-format.md states; this is a second implementation of it on top
of transformers' own template renderer, tokenizer and offsets (no torch needed).

--method qwen3-find (Qwen3's template, which strips <think> blocks from assistant turns before the
last user query, so prefix renderings are not prefixes of the whole): an independent method that
knows what Qwen3 writes for each assistant turn: body = the answer after its </think> (turns
before the last user query) or "<think>\nR\n</think>\n\n" + answer (the last turns), and finds
"<|im_start|>assistant\n" + body + "<|im_end|>" in the final rendering with str.find from a running
cursor. The span is body + "<|im_end|>", less the part of the generation prompt past the header
that the body begins with ("<think>\n\n</think>\n\n" with enable_thinking=false).

Usage:
  python tools/prepare_reference.py expected --gguf .cache/models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --input tests/fixtures/prepare/chats_openai.jsonl --output tests/fixtures/prepare/expected_smollm2.jsonl
  python tools/prepare_reference.py expected --tokenizer-json ../shared/data/tokenizers/hf/qwen2/tokenizer.json.gz \
      --template ../shared/data/tokenizers/chat_templates/qwen2.5-instruct.jinja \
      --input tests/fixtures/prepare/chats_openai.jsonl --output tests/fixtures/prepare/expected_qwen25.jsonl
  python tools/prepare_reference.py expected --tokenizer-json ../shared/data/tokenizers/hf/qwen2/tokenizer.json.gz \
      --template ../shared/data/tokenizers/chat_templates/qwen3.jinja --method qwen3-find \
      [--kwargs '{"enable_thinking": false}'] --input tests/fixtures/prepare/chats_qwen3.jsonl \
      --output tests/fixtures/prepare/expected_qwen3.jsonl   (expected_qwen3_nothink.jsonl)
  python tools/prepare_reference.py demo-chats   # examples/demo_chats.jsonl from the shared data
"""
import argparse
import gzip
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPACE = " \t\n\r"


def load_tokenizer(args):
    if args.gguf:
        from transformers import AutoTokenizer
        d, f = os.path.split(os.path.abspath(args.gguf))
        return AutoTokenizer.from_pretrained(d, gguf_file=f)
    from transformers import PreTrainedTokenizerFast
    path = args.tokenizer_json
    if path.endswith(".gz"):
        tmp = tempfile.NamedTemporaryFile(suffix=".json", delete=False)
        tmp.write(gzip.open(path).read())
        tmp.close()
        path = tmp.name
    tok = PreTrainedTokenizerFast(tokenizer_file=path)
    tok.chat_template = open(args.template, encoding="utf-8").read()
    return tok


KWARGS = {}


def render(tok, messages, gen):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **KWARGS)


def qwen3_spans(messages, text):
    header, eot = "<|im_start|>assistant\n", "<|im_end|>"
    extra = "<think>\n\n</think>\n\n" if KWARGS.get("enable_thinking") is False else ""
    last_query = len(messages) - 1
    for k in range(len(messages) - 1, -1, -1):
        c = messages[k]["content"]
        if messages[k]["role"] == "user" and not (c.startswith("<tool_response>") and c.endswith("</tool_response>")):
            last_query = k
            break
    spans, cursor = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        content, reasoning = m["content"], ""
        if "</think>" in content:
            reasoning = content.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n")
            content = content.split("</think>")[-1].lstrip("\n")
        if i > last_query and (i == len(messages) - 1 or reasoning):
            body = "<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + content.lstrip("\n")
        else:
            body = content
        h = text.find(header + body + eot, cursor)
        assert h >= 0, f"assistant turn {i} not found after byte {cursor}"
        lead = 0
        while lead < min(len(body), len(extra)) and body[lead] == extra[lead]:
            lead += 1
        begin = h + len(header) + lead
        end = h + len(header) + len(body) + len(eot)
        spans.append((begin, end))
        cursor = end
    return spans


def spans_of(tok, messages, text):
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        through = render(tok, messages[: i + 1], False)
        assert text.startswith(through), f"messages[:{i + 1}] rendering is not a prefix"
        begin = None
        try:
            before = render(tok, messages[:i], True) if i > 0 else None
            if before is not None and through.startswith(before):
                begin = len(before)
        except Exception:
            begin = None
        if begin is None:
            a = [dict(x) for x in messages[: i + 1]]
            b = [dict(x) for x in messages[: i + 1]]
            a[i]["content"] = "@@python-probe-1@@"
            b[i]["content"] = "##python-probe-2##"
            ra, rb = render(tok, a, False), render(tok, b, False)
            cp = 0
            while cp < min(len(ra), len(rb)) and ra[cp] == rb[cp]:
                cp += 1
            assert cp <= len(through) and through[:cp] == ra[:cp]
            begin = cp
        end = len(through)
        while end > begin and text[end - 1] in SPACE:
            end -= 1
        spans.append((begin, end))
    return spans


def expected(tok, messages):
    text = render(tok, messages, False)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    spans = qwen3_spans(messages, text) if METHOD == "qwen3-find" else spans_of(tok, messages, text)
    mask = [int(e > s and any(s < se and e > sb for sb, se in spans)) for s, e in offs]
    return ids, mask, text


METHOD = "prefix"


def cmd_expected(args):
    global METHOD
    METHOD = args.method
    KWARGS.update(json.loads(args.kwargs))
    tok = load_tokenizer(args)
    rows = []
    for line in open(args.input, encoding="utf-8"):
        if not line.strip():
            continue
        r = json.loads(line)
        ids, mask, text = expected(tok, r["messages"])
        rows.append({"id": r["id"], "input_ids": ids, "loss_mask": mask})
        masked = tok.decode([t for t, m in zip(ids, mask) if m])
        print(f"{r['id']}: {len(ids)} tokens, {sum(mask)} masked: {masked!r}", file=sys.stderr)
    with open(args.output, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(f"wrote {len(rows)} rows to {args.output}", file=sys.stderr)


def cmd_demo_chats(args):
    """examples/demo_chats.jsonl: the 8 conversations of examples/demo_tokens.jsonl (ids from
    tools/make_golden.py --demo), contents stripped as make_golden.py does; ShareGPT ones as
    ShareGPT lines, GSM8K ones as OpenAI messages lines."""
    data = os.path.join(ROOT, "..", "shared", "data", "train")
    ids = [json.loads(l)["id"] for l in open(os.path.join(ROOT, "examples", "demo_tokens.jsonl"))]
    sg = {}
    for l in open(os.path.join(data, "sharegpt_1k", "sharegpt_1k.jsonl"), encoding="utf-8"):
        r = json.loads(l)
        sg[r["id"]] = r
    gs = [json.loads(l) for l in open(os.path.join(data, "gsm8k", "train.jsonl"), encoding="utf-8") if l.strip()]
    out = []
    for i in ids:
        if i.startswith("sharegpt-"):
            r = sg[i[len("sharegpt-"):]]
            out.append({"id": i, "conversations": [{"from": c["from"], "value": c["value"].strip()}
                                                   for c in r["conversations"]]})
        else:
            g = gs[int(i.rsplit("-", 1)[1])]
            out.append({"id": i, "messages": [{"role": "user", "content": g["question"].strip()},
                                              {"role": "assistant", "content": g["answer"].strip()}]})
    with open(args.output, "w", encoding="utf-8") as f:
        for r in out:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"wrote {len(out)} conversations to {args.output}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("expected")
    g = e.add_mutually_exclusive_group(required=True)
    g.add_argument("--gguf")
    g.add_argument("--tokenizer-json")
    e.add_argument("--template", help="chat template (.jinja) for --tokenizer-json")
    e.add_argument("--input", required=True)
    e.add_argument("--output", required=True)
    e.add_argument("--method", choices=["prefix", "qwen3-find"], default="prefix",
                   help="prefix: the documented prefix rule; qwen3-find: str.find of each Qwen3 turn")
    e.add_argument("--kwargs", default="{}", help="template kwargs (JSON object), as --template-kwargs")
    d = sub.add_parser("demo-chats")
    d.add_argument("--output", default=os.path.join(ROOT, "examples", "demo_chats.jsonl"))
    args = ap.parse_args()
    if args.cmd == "expected":
        if args.tokenizer_json and not args.template:
            ap.error("--tokenizer-json needs --template")
        cmd_expected(args)
    else:
        cmd_demo_chats(args)


if __name__ == "__main__":
    main()
