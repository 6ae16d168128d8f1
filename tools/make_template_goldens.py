#!/usr/bin/env python3
"""Golden renders for talon's chat-template interpreter, with transformers as the oracle.

Writes into tests/fixtures/templates/:
  *.jinja            copies of ../shared/data/tokenizers/chat_templates/*.jinja (+ smollm2.jinja
                     read from the SmolLM2 GGUF's tokenizer.chat_template when present)
  goldens.jsonl      one line per (template, conversation, add_generation_prompt, kwargs):
                     {"template", "case", "messages", "add_generation_prompt", "kwargs",
                      "expected" | "error"}  -- rendered by transformers' own path
                     (_normalize_chat_messages + special tokens + render_jinja_template)
  jinja_cases.jsonl  interpreter unit cases: {"name", "template", "context",
                     "expected" | "error": {"kind": "syntax"|"runtime"|"raise", "line", "message"}}
                     rendered by the same Jinja environment transformers compiles templates in.

strftime_now is pinned to 2025-03-07 09:05:00 (the C++ tests inject the same time).
Usage: python3 tools/make_template_goldens.py   (from the repo root; transformers 5.x + jinja2)
"""
import datetime as _dt
import json
import os
import shutil
import sys

import jinja2
import transformers
from transformers.utils import chat_template_utils as ctu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(ROOT, "..", "shared", "data", "tokenizers", "chat_templates")
OUT = os.path.join(ROOT, "tests", "fixtures", "templates")
GGUF = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")

PINNED = _dt.datetime(2025, 3, 7, 9, 5, 0)


class _FixedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return PINNED


ctu.datetime = _FixedDatetime  # strftime_now() looks datetime up at call time

# bos/eos per template: from the matching tokenizer_configs/*.json where there is one.
def _cfg_tokens(name):
    path = os.path.join(SRC, "tokenizer_configs", name)
    cfg = json.load(open(path, encoding="utf-8"))
    out = {}
    for k in ("bos_token", "eos_token"):
        v = cfg.get(k)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[k] = v
    return out


LLAMA = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
MISTRAL = {"bos_token": "<s>", "eos_token": "</s>"}
TEMPLATES = {
    "llama-3.1-instruct.jinja": LLAMA,
    "llama-3.2-instruct.jinja": LLAMA,
    "llama-3.3-instruct.jinja": LLAMA,
    "qwen2.5-instruct.jinja": _cfg_tokens("qwen2.5_tokenizer_config.json"),
    "qwen3.jinja": _cfg_tokens("qwen3_tokenizer_config.json"),
    "qwen3_hf-2025-10.jinja": _cfg_tokens("qwen3-30b-a3b_tokenizer_config.json"),
    "qwq-32b.jinja": _cfg_tokens("qwen2.5_tokenizer_config.json"),
    "mistral-nemo-instruct-2407.jinja": MISTRAL,
    "mistral-small-3.1-instruct-2503.jinja": MISTRAL,
    "mistral-small-3.2-instruct-2506.jinja": MISTRAL,
    "deepseek-v3.1.jinja": _cfg_tokens("deepseek-v3.1_tokenizer_config.json"),
    "kimi-k2-instruct.jinja": _cfg_tokens("kimi-k2_tokenizer_config.json"),
    "kimi-k2-instruct_v2_crlf-inferred.jinja": _cfg_tokens("kimi-k2_tokenizer_config.json"),
    "kimi-k2-thinking.jinja": _cfg_tokens("kimi-k2_tokenizer_config.json"),
    "smollm3.jinja": _cfg_tokens("smollm3_tokenizer_config.json"),
}

LONG = " ".join(f"word{i}" for i in range(150)) + "\n\n" + "line\n" * 20
CONVERSATIONS = {
    "system_multi_turn": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello! What is 2+2?"},
        {"role": "assistant", "content": "2+2 is 4."},
        {"role": "user", "content": "And 3+3?"},
        {"role": "assistant", "content": "3+3 is 6."},
    ],
    "no_system": [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why?"},
    ],
    "single_user": [{"role": "user", "content": "  Hi there  \n"}],
    "starts_with_assistant": [
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Nothing."},
    ],
    "empty_content": [
        {"role": "system", "content": ""},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": ""},
    ],
    "unicode": [
        {"role": "system", "content": "Réponds en français. 日本語もOK。"},
        {"role": "user", "content": "Ça va? 😀 \u00a0«quotes» \"dq\" 'sq' \\ back\ttab"},
        {"role": "assistant", "content": "Très bien 👍 — Ω≈ç√"},
    ],
    "long_text": [
        {"role": "user", "content": LONG},
        {"role": "assistant", "content": LONG[::-1]},
    ],
    "whitespace_edges": [
        {"role": "system", "content": "\n\n  padded system  \n"},
        {"role": "user", "content": "\nline1\nline2\n\n"},
        {"role": "assistant", "content": "\n\nanswer\n"},
    ],
    "null_keys": [
        {"role": "user", "content": "q", "name": None},
        {"role": "assistant", "content": "a", "tool_calls": None},
    ],
    "think_history": [
        {"role": "user", "content": "What is 1+1?"},
        {"role": "assistant", "content": "<think>\nSimple arithmetic.\n</think>\n\n1+1 = 2."},
        {"role": "user", "content": "And 2+2?"},
        {"role": "assistant", "content": "<think>\nAgain simple.\n</think>\n\n2+2 = 4."},
    ],
    "reasoning_field": [
        {"role": "user", "content": "Why is the sky blue?"},
        {"role": "assistant", "content": "Rayleigh scattering.", "reasoning_content": "Think about light."},
    ],
    "two_users_in_a_row": [
        {"role": "user", "content": "first"},
        {"role": "user", "content": "second"},
    ],
    "bad_role": [
        {"role": "user", "content": "hi"},
        {"role": "narrator", "content": "meanwhile"},
    ],
    "system_think_flags": [
        {"role": "system", "content": "Be brief. /no_think"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ],
}

THINK_TEMPLATES = {"qwen3.jinja", "qwen3_hf-2025-10.jinja", "qwq-32b.jinja", "deepseek-v3.1.jinja",
                   "smollm3.jinja", "kimi-k2-thinking.jinja"}


def render(template, messages, agp, kwargs):
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    conv = ctu._normalize_chat_messages(messages)
    rendered, _ = ctu.render_jinja_template(
        conversations=[conv], chat_template=template, add_generation_prompt=agp, **kwargs)
    return rendered[0]


def golden_lines(name, template, tokens):
    lines = []
    for case, messages in CONVERSATIONS.items():
        kw_variants = [("", {})]
        if name in ("qwen3.jinja", "qwen3_hf-2025-10.jinja", "smollm3.jinja"):
            kw_variants += [("think_on", {"enable_thinking": True}), ("think_off", {"enable_thinking": False})]
        if name == "deepseek-v3.1.jinja":
            kw_variants += [("thinking", {"thinking": True})]
        if case in ("think_history", "reasoning_field") and name not in THINK_TEMPLATES:
            kw_variants = kw_variants[:1]
        for suffix, extra in kw_variants:
            for agp in (False, True):
                kwargs = dict(tokens)
                kwargs.update(extra)
                line = {"template": name, "case": case + ("+" + suffix if suffix else ""),
                        "messages": messages, "add_generation_prompt": agp, "kwargs": kwargs}
                try:
                    line["expected"] = render(template, messages, agp, kwargs)
                except jinja2.exceptions.TemplateError as e:
                    if type(e) is not jinja2.exceptions.TemplateError:  # not raise_exception
                        line["error_kind"] = "runtime"
                    line["error"] = str(e)
                lines.append(line)
    return lines


def env():
    return ctu._compile_jinja_template("x").environment


# ---------------------------------------------------------------- interpreter unit cases
UNIT = [
    # expressions / literals / arithmetic / Python str() of values
    ("int_float", "{{ 1 }}|{{ 1.0 }}|{{ 1.5e3 }}|{{ 10 / 4 }}|{{ 10 // 4 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 2 ** 10 }}|{{ 0.1 + 0.2 }}|{{ 1e20 }}|{{ 1e-5 }}|{{ 3 * 'ab' }}", {}),
    ("bool_none_repr", "{{ true }}|{{ none }}|{{ [1, 'a', none, true, 2.5] }}|{{ {'k': 'v', 'n': [1]} }}|{{ (1,) }}|{{ ('a', 2) }}", {}),
    ("str_repr_quotes", "{{ [\"it's\", 'say \"hi\"', 'both \\' \"', 'nl\\n'] }}", {}),
    ("concat", "{{ 'a' ~ 1 ~ none ~ true }}|{{ 'a' + 'b' }}|{{ [1] + [2, 3] }}", {}),
    ("compare_logic", "{{ 1 < 2 < 3 }}|{{ 1 == 1.0 }}|{{ 'a' < 'b' }}|{{ not 0 }}|{{ 0 or 'x' }}|{{ '' and 'y' }}|{{ 1 if none else 2 }}|{{ 'x' if 1 }}", {}),
    ("in_notin", "{{ 'a' in 'cat' }}|{{ 2 in [1,2] }}|{{ 'k' in {'k': 1} }}|{{ 'z' not in 'cat' }}|{{ 'x' in undefined_thing }}", {}),
    ("truthiness", "{% for v in [0, 1, '', 'a', [], [0], {}, none, 0.0] %}{{ 'T' if v else 'F' }}{% endfor %}", {}),
    ("slicing", "{{ 'hello'[1:3] }}|{{ 'hello'[::-1] }}|{{ 'hello'[-3:] }}|{{ [1,2,3,4,5][::2] }}|{{ [1,2,3][-1] }}|{{ 'héllo'[1] }}|{{ [1,2,3][5:] }}|{{ 'abc'[:-1] }}", {}),
    ("unicode_len", "{{ 'héllo😀'|length }}|{{ 'héllo😀'[-1] }}|{{ 'añb'|upper }}", {}),
    # whitespace control
    ("ws_dash", "a  {{- 'b' -}}  c\n  {%- if true -%}  d  {%- endif -%}  e", {}),
    ("ws_trim_lstrip", "start\n    {% if true %}\n    inside\n    {% endif %}\nend\n", {}),
    ("ws_plus", "x\n    {%+ if true %}y{% endif +%}\nz", {}),
    ("ws_comment", "a\n  {# comment #}\nb {#- c -#} c\n", {}),
    ("ws_var_no_trim", "{{ 'a' }}\n{{ 'b' }}\n", {}),
    ("ws_trailing_newline", "x\n\n", {}),
    ("crlf", "a\r\n{% if true %}\r\nb\r\n{% endif %}\r\nc", {}),
    ("raw", "{% raw %}{{ not parsed }}{% endraw %}", {}),
    # loops
    ("loop_vars", "{% for x in ['a','b','c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }};{% endfor %}", {}),
    ("loop_filter_else", "{% for x in range(10) if x % 3 == 0 %}{{ x }}{{ ',' if not loop.last }}{% else %}none{% endfor %}|{% for x in [] %}x{% else %}empty{% endfor %}", {}),
    ("loop_dict_unpack", "{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{% for k in d %}{{ k }}{% endfor %}", {"d": {"b": 1, "a": 2}}),
    ("loop_scope", "{% set x = 5 %}{% for i in [1,2,3] %}{{ x }}{% set x = i %}{% endfor %}|{{ x }}", {}),
    ("loop_break_continue", "{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}{% if i == 5 %}{% break %}{% endif %}{{ i }}{% endfor %}", {}),
    ("loop_cycle_nested", "{% for i in [1,2] %}{% for j in [1,2] %}{{ loop.cycle('a','b') }}{{ i }}{{ j }}{% endfor %}{% endfor %}", {}),
    ("range_args", "{{ range(3)|list }}{{ range(1, 7, 2)|list }}{{ range(5, 0, -2)|list }}", {}),
    # set / namespace / macros
    ("namespace", "{% set ns = namespace(a=1, b='x') %}{% for i in range(3) %}{% set ns.a = ns.a + i %}{% endfor %}{{ ns.a }}{{ ns.b }}", {}),
    ("set_block", "{% set x %}inner {{ 1 + 1 }}{% endset %}[{{ x }}]{% set y | upper %}abc{% endset %}{{ y }}", {}),
    ("set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}", {}),
    ("macro", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('Bob') }} {{ greet('Al', punct='?') }} {{ greet() }}", {}),
    # tests
    ("tests", "{{ x is defined }}{{ y is undefined }}{{ none is none }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is iterable }}{{ [] is sequence }}{{ 1 is number }}{{ 1.5 is number }}{{ true is true }}{{ false is false }}{{ 1 is true }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 1 is integer }}{{ 1.0 is float }}{{ 'a' is eq 'a' }}{{ 2 is in [1,2] }}", {"x": 1}),
    ("test_nested_defined", "{{ d.a is defined }}{{ d.k.x is defined }}{{ d['a'] is not defined }}{{ s.content is defined }}", {"d": {"k": {}}, "s": "str"}),
    # filters
    ("filters_basic", "{{ '  x  '|trim }}|{{ 'ab'|upper }}|{{ 'AB'|lower }}|{{ 'hello world-foo'|title }}|{{ 'hELLO'|capitalize }}|{{ 'aXa'|replace('a','b') }}|{{ [1,2]|join(',') }}|{{ [3,4]|first }}{{ [3,4]|last }}|{{ u|default('dflt') }}|{{ ''|default('e', true) }}|{{ 'abc'|list }}|{{ 42|string }}|{{ '7'|int + 1 }}|{{ 'x'|int }}|{{ '2.5'|float }}|{{ [1,2,2,'a','A']|unique|list }}|{{ [3,1,2]|sort }}|{{ [1,2]|reverse|list }}|{{ 'abc'|reverse }}|{{ [1,2,3]|sum }}|{{ -3|abs }}", {}),
    ("filters_attr", "{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='content')|join('/') }}|{{ ms|rejectattr('role', 'eq', 'user')|list|length }}|{{ ms|map(attribute='role')|list }}|{{ ['a','code','b']|reject('equalto', 'code')|join(', ') }}|{{ ms|selectattr('x')|list }}", {"ms": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "x": 1}, {"role": "user", "content": "c"}]}),
    ("filter_items_count", "{{ d|items|list }}|{{ d|length }}|{{ d|count }}|{{ 'abc'|length }}|{{ undefined_var|length }}", {"d": {"a": 1, "b": [2]}}),
    ("filter_indent", "{{ 'a\nb\n\nc'|indent(2) }}|{{ 'a\nb'|indent(2, true) }}|{{ 'a\n\nb'|indent(3, blank=true) }}", {}),
    ("tojson", "{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ [] | tojson(indent=4) }}|{{ {} | tojson }}|{{ 'é\"\\\\\n\u0001<>&'|tojson }}|{{ 1.0|tojson }}|{{ none|tojson }}|{{ d|tojson(separators=(',', ':')) }}|{{ d|tojson(sort_keys=true) }}", {"d": {"z": 1, "a": [1.5, True, None, "ü"], "n": {"x": {}}}}),
    # string / dict methods
    ("str_methods", "{{ '  a b  '.strip() }}|{{ 'xxaxx'.strip('x') }}|{{ '\\n\\na'.lstrip('\\n') }}|{{ 'a\\n\\n'.rstrip() }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a,b,c'.split(',', 1) }}|{{ 'a,b,c'.rsplit(',', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'aaa'.replace('a', 'b', 2) }}|{{ 'héllo'.find('l') }}|{{ 'abc'.find('z') }}|{{ 'ab'.upper() }}|{{ 'hello there'.title() }}|{{ '-'.join(['a','b']) }}|{{ '{} and {}'.format('x', 1) }}", {}),
    ("think_split", "{% set c = '<think>\\nR\\n</think>\\n\\nAnswer' %}{{ c.split('</think>')[-1].lstrip('\\n') }}|{{ c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}|{{ c.split('</think>', 1)[1] }}", {}),
    ("dict_methods", "{{ d.keys()|list }}{{ d.values()|list }}{{ d.get('a') }}{{ d.get('z') }}{{ d.get('z', 'dflt') }}{{ d.a }}{{ d['b'] }}{{ d.items()|list }}", {"d": {"a": 1, "b": 2}}),
    ("string_escapes", "{{ 'tab\\there' }}|{{ \"q\\\"q\" }}|{{ 'uni\\u00e9\\x41' }}|{{ 'cont\\\nline' }}|{{ 'unknown\\d' }}", {}),
    ("undefined_print", "[{{ nope }}][{{ d.missing }}][{{ l[10] }}]", {"d": {}, "l": []}),
    ("strftime", "{{ strftime_now('%d %b %Y') }}|{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %B %Y') }}", {}),
    ("generation_tag", "a{% generation %}b{{ 1 }}{% endgeneration %}c", {}),
    ("filter_block", "{% filter upper %}abc{{ 'd' }}{% endfilter %}", {}),
    # errors
    ("err_raise", "line1\n{{ raise_exception('Bad thing: ' ~ 42) }}", {}),
    ("err_syntax_line", "ok\n{% if x %}\n{{ 1 + }}\n{% endif %}", {}),
    ("err_unclosed", "a\n{% for x in y %}\nb", {}),
    ("err_unknown_filter", "a\nb\n{{ x|nosuchfilter }}", {}),
    ("err_unknown_test", "{{ x is nosuchtest }}", {}),
    ("err_unknown_tag", "\n{% frobnicate %}", {}),
    ("err_undefined_attr", "{{ foo.bar }}", {}),
    ("err_dict_attr_chain", "{{ d.a.b }}", {"d": {}}),
    ("err_concat_type", "{{ 'a' + 1 }}", {}),
    ("err_append_unsafe", "{% set l = [] %}{{ l.append(1) }}", {}),
    ("err_not_namespace", "{% set d = {} %}{% set d.x = 1 %}", {}),
    # numbers past the machine's range (fuzzer finds): floats saturate as Python's float()
    # does; huge indices are simply out of range
    ("num_past_range", "{{ 1e999 }}|{{ 8888e888888 }}|{{ -1e999 }}|{{ 1e-999 }}|{{ 0.1e400 }}", {}),
    ("map_attr_huge_index", "{{ ls|map(attribute='99999999999999999999')|select('defined')|list }}|{{ ls|map(attribute='0')|list }}", {"ls": [[1], [2]]}),
    ("err_format_huge_index", "{{ '{99999999999999999999999}'.format(1) }}", {}),
]


def unit_lines():
    e = env()
    lines = []
    for name, src, ctx in UNIT:
        line = {"name": name, "template": src, "context": ctx}
        try:
            line["expected"] = e.from_string(src).render(**ctx)
        except jinja2.exceptions.TemplateSyntaxError as ex:
            line["error"] = {"kind": "syntax", "line": ex.lineno, "message": ex.message}
        except jinja2.exceptions.TemplateError as ex:
            kind = "raise" if type(ex) is jinja2.exceptions.TemplateError else "runtime"
            line["error"] = {"kind": kind, "message": str(ex)}
        except Exception as ex:  # TypeError etc. propagate out of jinja unchanged
            line["error"] = {"kind": "runtime", "message": str(ex)}
        lines.append(line)
    return lines


def main():
    print(f"transformers {transformers.__version__}, jinja2 {jinja2.__version__}", file=sys.stderr)
    os.makedirs(OUT, exist_ok=True)
    templates = {}
    for name, tokens in TEMPLATES.items():
        src_path = os.path.join(SRC, name)
        shutil.copyfile(src_path, os.path.join(OUT, name))
        with open(src_path, encoding="utf-8", newline="") as f:
            templates[name] = (f.read(), tokens)
    if os.path.exists(GGUF):
        import gguf
        r = gguf.GGUFReader(GGUF)
        def field_str(key):
            f = r.fields[key]
            return bytes(f.parts[f.data[0]]).decode("utf-8")
        tmpl = field_str("tokenizer.chat_template")
        tf = r.fields["tokenizer.ggml.tokens"]
        toks = {}
        for key, tname in (("tokenizer.ggml.bos_token_id", "bos_token"), ("tokenizer.ggml.eos_token_id", "eos_token")):
            if key in r.fields:
                tid = int(r.fields[key].parts[r.fields[key].data[0]][0])
                toks[tname] = bytes(tf.parts[tf.data[tid]]).decode("utf-8")
        with open(os.path.join(OUT, "smollm2.jinja"), "w", encoding="utf-8", newline="") as f:
            f.write(tmpl)
        templates["smollm2.jinja"] = (tmpl, toks)
    else:
        print(f"warning: {GGUF} absent, no smollm2 goldens", file=sys.stderr)

    n = 0
    with open(os.path.join(OUT, "goldens.jsonl"), "w", encoding="utf-8") as f:
        for name, (src, tokens) in templates.items():
            for line in golden_lines(name, src, tokens):
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
                n += 1
    with open(os.path.join(OUT, "jinja_cases.jsonl"), "w", encoding="utf-8") as f:
        for line in unit_lines():
            f.write(json.dumps(line, ensure_ascii=False) + "\n")
    print(f"{n} goldens over {len(templates)} templates, {len(UNIT)} unit cases -> {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
