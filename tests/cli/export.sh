#!/usr/bin/env bash
# talon export and talon report end to end: a short `talon train` run on SmolLM2 features
# of the demo chats is exported to both engine formats in fp32 and bf16 and checked
# against the checkpoint by an independent reader (check_export.py: safetensors + json);
# refusals exit non-zero and leave nothing behind; the report has one chart per metric
# with one point per logged step.
source "$(dirname "$0")/lib.sh"
GGUF=${TALON_SMOLLM2_GGUF:-$SRC/.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$GGUF" ] || { echo "missing $GGUF (run scripts/fetch_model.sh)"; exit 1; }
CHECK="$SRC/tests/cli/check_export.py"
demo_features "$WORK" || bad "prepare + extract"
train=(--data "$WORK/feat" --model "$GGUF" --draft-vocab 256 --max-length 64 --ttt-steps 2 --lr 1e-3)
"$TALON" train "${train[@]}" --max-steps 3 --out "$WORK/run" > /dev/null 2> "$WORK/train.err" && ok "trained 3 steps" \
  || bad "train: $(tail -3 "$WORK/train.err")"

for fmt in speculators sglang; do
  for dt in fp32 bf16; do
    out="$WORK/export-$fmt-$dt"
    if "$TALON" export --checkpoint "$WORK/run" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format $fmt --dtype $dt --speculative-tokens 5 \
         --out "$out" > "$WORK/e.out" 2> "$WORK/e.err"; then
      msg=$(python3 "$CHECK" "$WORK/run/checkpoint.safetensors" "$out" $fmt $dt 5 2>&1) && ok "$msg" || bad "$fmt $dt: $msg"
    else
      bad "export $fmt $dt: $(tail -3 "$WORK/e.err")"
    fi
  done
done

# The export prints how to serve it; inspect summarises the run, its checkpoint and both exports.
"$TALON" export --checkpoint "$WORK/run" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format speculators --speculative-tokens 5 \
  --out "$WORK/export-serve" > "$WORK/e.out" 2>&1
grep -q "vllm serve .*--speculative-config .*\"num_speculative_tokens\": 5" "$WORK/e.out" \
  && ok "export prints the vllm serve command" || bad "export output: $(cat "$WORK/e.out")"
for p in "$WORK/run" "$WORK/run/checkpoint.safetensors"; do
  "$TALON" inspect "$p" > "$WORK/i.out" 2>&1 || bad "inspect $p: $(tail -3 "$WORK/i.out")"
  python3 - "$WORK/run/checkpoint.safetensors" "$WORK/i.out" <<'PY' && ok "inspect summarises a checkpoint ($(basename "$p"))" \
    || bad "inspect $p: $(head -30 "$WORK/i.out")"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
meta = json.loads(raw[8:8 + n])["__metadata__"]
st = json.loads(meta["talon.train"])
out = open(sys.argv[2]).read()
assert out.startswith("training run "), out[:80]
assert f"step          {st['step']}" in out, out
for k, v in st["job"].items():
    assert any(l.split()[:1] == [k] for l in out.splitlines()), k
assert "AdamW moments" in out and "m.fc" not in out and "held back" in out, out
PY
done
for fmt in speculators sglang; do
  "$TALON" inspect "$WORK/export-$fmt-bf16" > "$WORK/i.out" 2>&1 || bad "inspect export $fmt: $(tail -3 "$WORK/i.out")"
  python3 - "$WORK/export-$fmt-bf16/config.json" "$WORK/i.out" $fmt <<'PY' && ok "inspect reads the $fmt export" \
    || bad "inspect $fmt: $(cat "$WORK/i.out")"
import json, sys
cfg = json.load(open(sys.argv[1]))
out = open(sys.argv[2]).read()
fmt = sys.argv[3]
assert out.startswith("draft export "), out[:80]
assert f"vocab {cfg['draft_vocab_size']} of" in out and "dtype BF16" in out, out
if fmt == "sglang":
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert "stored as " + ",".join(map(str, ids)) in out and "sglang.launch_server" in out, out
    assert "(input-of-layer)" in out and ",".join(str(i + 1) for i in ids) + " (input-of-layer)" in out, out
else:
    ids = cfg["eagle_aux_hidden_state_layer_ids"]
    assert ",".join(map(str, ids)) + " (input-of-layer)" in out and "vllm serve" in out, out
PY
done

# Refusals.
"$TALON" export --checkpoint "$WORK/run" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format sglang --out "$WORK/export-sglang-fp32" > /dev/null 2> "$WORK/r1"
[ $? -ne 0 ] && grep -q "already exists and is not an empty directory" "$WORK/r1" && ok "existing output refused" || bad "$(cat "$WORK/r1")"
"$TALON" export --checkpoint "$WORK/run" --model "$SRC/tests/fixtures/golden/llama_gqa" --verifier org/llama --format speculators --out "$WORK/x1" > /dev/null 2> "$WORK/r2"
[ $? -ne 0 ] && grep -q "target_config_sha256 is .* but --model .* has config sha256" "$WORK/r2" && [ ! -e "$WORK/x1" ] \
  && ok "checkpoint of another target refused" || bad "$(cat "$WORK/r2")"
"$TALON" export --checkpoint "$WORK/run" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format onnx --out "$WORK/x2" > /dev/null 2> "$WORK/r3"
[ $? -ne 0 ] && grep -q "unknown export format 'onnx'" "$WORK/r3" && ok "unknown format refused" || bad "$(cat "$WORK/r3")"
"$TALON" train "${train[@]}" --max-steps 1 --norm-before-residual --out "$WORK/nbr" > /dev/null 2>&1 || bad "train nbr"
"$TALON" export --checkpoint "$WORK/nbr" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format sglang --out "$WORK/x3" > /dev/null 2> "$WORK/r4"
[ $? -ne 0 ] && grep -q "norm_before_residual = true, which SGLang" "$WORK/r4" && [ ! -e "$WORK/x3" ] \
  && ok "norm_before_residual refused for SGLang" || bad "$(cat "$WORK/r4")"
"$TALON" export --checkpoint "$WORK/nbr" --model "$GGUF" --verifier HuggingFaceTB/SmolLM2-135M-Instruct --format speculators --dtype fp32 --speculative-tokens 3 --out "$WORK/x4" > /dev/null 2>&1 \
  && python3 "$CHECK" "$WORK/nbr/checkpoint.safetensors" "$WORK/x4" speculators fp32 3 > /dev/null 2>&1 \
  && python3 -c "import json,sys; assert json.load(open(sys.argv[1]))['norm_before_residual'] is True" "$WORK/x4/config.json" \
  && ok "norm_before_residual = true exported explicitly for vLLM" || bad "nbr speculators export"
ls -a "$WORK" | grep -q "\.tmp-" && bad "temporary directories left: $(ls -a "$WORK")" || ok "no temporary directories left"

# Report.
"$TALON" report --run "$WORK/run" --out "$WORK/report.html" > /dev/null 2> "$WORK/rep.err" || bad "report: $(cat "$WORK/rep.err")"
python3 - "$WORK/report.html" "$WORK/run/metrics.jsonl" <<'PY' && ok "report: one SVG per metric, one point per step" || bad "report content"
import json, re, sys
html = open(sys.argv[1]).read()
lines = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
rows = [r for r in lines if "split" not in r]
evals = [r for r in lines if r.get("split") == "eval"]
charts = re.findall(r'<svg [^>]*data-chart="([^"]+)"', html)
assert charts == ["loss", "acc", "cond_acc", "sim_accept_len", "lr", "grad_norm", "tokens_per_s"], charts
assert "<script" not in html
def points(chart, series):
    block = html[html.index(f'data-chart="{chart}"'):]
    block = block[:block.index("</svg>")]
    m = re.search(rf'<polyline data-series="{re.escape(series)}" data-points="(\d+)"[^>]* points="([^"]*)"', block)
    assert m, (chart, series)
    assert len(m.group(2).split()) == int(m.group(1)), (chart, series)
    return int(m.group(1))
assert points("loss", "train") == len(rows)
for k in range(len(rows[0]["acc"])):
    assert points("acc", f"train k={k}") == len(rows) and points("acc", f"eval k={k}") == len(evals)
assert points("tokens_per_s", "train") == len(rows)
assert evals and points("loss", "eval") == len(evals), "the held-back split is its own series"
PY
# Every chart draws in a real browser: no black or blank plot area; a broken copy must fail.
python3 "$SRC/tests/cli/check_charts.py" "$WORK/report.html" "$WORK" 7 > "$WORK/charts.out" 2>&1 \
  && ok "report charts render in headless Chromium ($(grep -c '^ok' "$WORK/charts.out"))" \
  || bad "report charts: $(grep -v '^ok' "$WORK/charts.out" | head -5)"
sed 's/fill="none" stroke="#888" stroke-width="1" class="plot-area"/stroke="#888" class="plot-area"/' \
  "$WORK/report.html" > "$WORK/broken.html"
python3 "$SRC/tests/cli/check_charts.py" "$WORK/broken.html" "$WORK" 7 > "$WORK/charts2.out" 2>&1
[ $? -ne 0 ] && grep -q "of the plot area is black" "$WORK/charts2.out" && ok "the chart check catches a black plot area" \
  || bad "broken charts passed: $(head -3 "$WORK/charts2.out")"
grep -q "Run settings" "$WORK/report.html" && grep -q "What the metrics mean" "$WORK/report.html" \
  && grep -q "<td>ttt_steps</td><td>2</td>" "$WORK/report.html" && ok "report: run settings and metric definitions" \
  || bad "report lacks settings or definitions"
# Two runs on one page: the settings that differ side by side, one series per run.
"$TALON" report --run "$WORK/run" "$WORK/nbr" --out "$WORK/cmp.html" > /dev/null 2> "$WORK/cmp.err" \
  || bad "report of two runs: $(tail -3 "$WORK/cmp.err")"
python3 - "$WORK/cmp.html" <<'PY' && ok "two runs compared on one page" || bad "comparison page"
import re, sys
html = open(sys.argv[1]).read()
assert "<td>norm_before_residual</td><td>false</td><td>true</td>" in html, "differing setting not shown"
for chart in ("cmp_sim_accept_len", "cmp_loss"):
    block = html[html.index(f'data-chart="{chart}"'):]
    block = block[:block.index("</svg>")]
    assert re.findall(r'data-series="(run|nbr)"', block) == ["run", "nbr"], chart
PY
# Tokens trained on: one epoch of every sample (none held back) counts each sample's tokens
# once, cut at --max-length as training cuts them (lengths from tokens.jsonl); a stopped and
# resumed run counts the same; the comparison's held-back charts put runs on that axis.
tt=(--data "$WORK/feat" --model "$GGUF" --draft-vocab 256 --max-length 64 --ttt-steps 1 --lr 1e-3 --eval-fraction 0)
"$TALON" train "${tt[@]}" --out "$WORK/tt" > /dev/null 2> "$WORK/tt.err" || bad "train tt: $(tail -3 "$WORK/tt.err")"
"$TALON" train "${tt[@]}" --stop-after-steps 3 --out "$WORK/tt2" > /dev/null 2>&1
"$TALON" train "${tt[@]}" --out "$WORK/tt2" > /dev/null 2> "$WORK/tt2.err" || bad "train tt2: $(tail -3 "$WORK/tt2.err")"
grep -q "resuming from .* at step 3 of 8" "$WORK/tt2.err" || bad "tt2 did not resume at step 3: $(grep -i resum "$WORK/tt2.err")"
python3 - "$WORK/tok/tokens.jsonl" "$WORK/tt/metrics.jsonl" "$WORK/tt2/metrics.jsonl" <<'PY' \
  && ok "tokens_trained counts every sample once per epoch, across a resume" || bad "tokens_trained"
import json, sys
total = sum(min(len(json.loads(l)["input_ids"]), 64) for l in open(sys.argv[1]) if l.strip())
def rows(p):
    return [r for r in map(json.loads, open(p)) if "split" not in r]
t = [r["tokens_trained"] for r in rows(sys.argv[2])]
assert len(t) == 8 and all(y > x for x, y in zip(t, t[1:])), t
assert t[-1] == total, (t[-1], total)
assert [r["tokens_trained"] for r in rows(sys.argv[3])] == t, t
PY
# Through a file, not a pipe: `grep -q` exits at its first match, and under pipefail the
# writer's SIGPIPE would fail the check whenever it had not finished writing by then.
grep -A400 'data-chart="cmp_acc0"' "$WORK/cmp.html" > "$WORK/cmp_acc0.html"
grep -q "tokens trained on" "$WORK/cmp_acc0.html" \
  && ok "held-back charts of a comparison are drawn against tokens trained on" || bad "cmp x axis"
printf '%s\n%s\n' "$(head -1 "$WORK/run/metrics.jsonl")" '{"step": "two"}' > "$WORK/bad.jsonl"
"$TALON" report --run "$WORK/bad.jsonl" --out "$WORK/bad.html" > /dev/null 2> "$WORK/rep2.err"
[ $? -ne 0 ] && grep -q "bad.jsonl:2: field 'step' must be an integer" "$WORK/rep2.err" && [ ! -e "$WORK/bad.html" ] \
  && ok "bad metrics line named" || bad "$(cat "$WORK/rep2.err")"
"$TALON" report --run "$WORK/nothing" --out "$WORK/n.html" > /dev/null 2> "$WORK/rep3.err"
[ $? -ne 0 ] && grep -q "nothing: missing" "$WORK/rep3.err" && ok "missing metrics refused" || bad "$(cat "$WORK/rep3.err")"
finish
