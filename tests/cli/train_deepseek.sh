#!/usr/bin/env bash
# talon train for MLA + MoE targets (the DeepSeek-V3 and Kimi-K2 int4 golden fixtures) and
# draft sizes set on the command line: offline from an extract dataset and online from the
# target in-process give the same losses bit for bit; both export formats check out against
# the checkpoint (check_export.py); the draft layer takes the target's heads at v_head_dim
# with plain RoPE at the target's base (read from the fixture's config.json here); the
# --draft-* sizes reach the checkpoint and the export; bad sizes and a resume with other
# sizes are refused.
source "$(dirname "$0")/lib.sh"
DS=$SRC/tests/fixtures/golden/deepseek_v3
KIMI=$SRC/tests/fixtures/golden/kimi_k2_int4
CHECK="$SRC/tests/cli/check_export.py"

tokens 10 96 7 24 > "$WORK/tok.jsonl"
"$TALON" extract --model "$DS" --data "$WORK/tok.jsonl" --layers 1,2,3 --out "$WORK/feat" > /dev/null 2> "$WORK/x.err" \
  && ok "extract (deepseek_v3 fixture)" || bad "extract: $(tail -3 "$WORK/x.err")"
args=(--model "$DS" --draft-vocab 40 --max-length 64 --ttt-steps 3 --batch-samples 2 --lr 1e-3 --seed 3)
"$TALON" train "${args[@]}" --max-steps 4 --data "$WORK/feat" --out "$WORK/off" > /dev/null 2> "$WORK/off.err" \
  && ok "offline training on a DeepSeek-V3 target" || bad "train: $(tail -3 "$WORK/off.err")"
"$TALON" train "${args[@]}" --max-steps 4 --online --layers 1,2,3 --data "$WORK/tok.jsonl" --out "$WORK/on" > /dev/null 2> "$WORK/on.err" \
  || bad "online: $(tail -3 "$WORK/on.err")"
a=$(losses "$WORK/off/metrics.jsonl"); b=$(losses "$WORK/on/metrics.jsonl")
[ -n "$a" ] && [ "$a" = "$b" ] && ok "online (MLA + MoE target in-process) logs the offline run's losses" || bad "online $b vs offline $a"

for fmt in speculators sglang; do
  for dt in fp32 bf16; do
    out="$WORK/e-$fmt-$dt"
    if "$TALON" export --checkpoint "$WORK/off" --model "$DS" --verifier "$DS" --format $fmt --dtype $dt --speculative-tokens 3 \
         --out "$out" > /dev/null 2> "$WORK/e.err"; then
      msg=$(python3 "$CHECK" "$WORK/off/checkpoint.safetensors" "$out" $fmt $dt 3 2>&1) && ok "$msg" || bad "$fmt $dt: $msg"
    else
      bad "export $fmt $dt: $(tail -3 "$WORK/e.err")"
    fi
  done
done
python3 - "$DS/config.json" "$WORK/e-speculators-fp32/config.json" "$WORK/e-sglang-fp32/config.json" <<'PY' \
  && ok "draft layer: the target's heads at v_head_dim, dense MLP width, plain RoPE at its base; verifier DeepseekV3ForCausalLM" \
  || bad "draft layer config"
import json, sys
t, spec, sgl = (json.load(open(p)) for p in sys.argv[1:4])
for layer in (spec["transformer_layer_config"], sgl):
    assert layer["num_attention_heads"] == t["num_attention_heads"], layer
    assert layer["num_key_value_heads"] == t["num_attention_heads"], layer
    assert layer["head_dim"] == t["v_head_dim"], layer
    assert layer["intermediate_size"] == t["intermediate_size"], layer
    assert layer["hidden_size"] == t["hidden_size"], layer
rope = t.get("rope_parameters") or dict(t.get("rope_scaling") or {}, rope_theta=t.get("rope_theta"))
for layer in (spec["transformer_layer_config"], sgl):
    assert layer["rope_theta"] == rope["rope_theta"] and layer["rope_scaling"] is None, layer
assert rope.get("rope_type", rope.get("type")) == "yarn", rope
assert spec["speculators_config"]["verifier"]["architectures"] == ["DeepseekV3ForCausalLM"], spec["speculators_config"]
PY

# Kimi-K2 layout with int4 experts, online.
"$TALON" train --model "$KIMI" --online --layers 1,2,3 --data "$WORK/tok.jsonl" --draft-vocab 40 --max-length 64 \
  --ttt-steps 2 --max-steps 2 --out "$WORK/kimi" > /dev/null 2> "$WORK/kimi.err" \
  && [ "$(losses "$WORK/kimi/metrics.jsonl" | wc -w)" -ge 2 ] && ok "online training on the Kimi-K2 int4 target" \
  || bad "kimi: $(tail -3 "$WORK/kimi.err")"

# Draft sizes from the command line.
sized=("${args[@]}" --max-steps 2 --draft-intermediate 20 --draft-heads 2 --draft-kv-heads 1 --draft-head-dim 6)
"$TALON" train "${sized[@]}" --data "$WORK/feat" --out "$WORK/sized" > /dev/null 2> "$WORK/sized.err" \
  || bad "sized: $(tail -3 "$WORK/sized.err")"
"$TALON" export --checkpoint "$WORK/sized" --model "$DS" --verifier "$DS" --format speculators --dtype fp32 --speculative-tokens 3 \
  --out "$WORK/e-sized" > /dev/null 2> "$WORK/es.err" || bad "export sized: $(tail -3 "$WORK/es.err")"
python3 "$CHECK" "$WORK/sized/checkpoint.safetensors" "$WORK/e-sized" speculators fp32 3 > /dev/null 2>&1 \
  && python3 - "$WORK/e-sized/config.json" "$WORK/sized/checkpoint.safetensors" <<'PY' \
  && ok "--draft-intermediate/heads/kv-heads/head-dim reach the checkpoint and the export" || bad "sized draft: $(cat "$WORK/es.err")"
import json, sys
from safetensors import safe_open
l = json.load(open(sys.argv[1]))["transformer_layer_config"]
assert (l["intermediate_size"], l["num_attention_heads"], l["num_key_value_heads"], l["head_dim"]) == (20, 2, 1, 6), l
with safe_open(sys.argv[2], framework="pt") as f:
    assert list(f.get_tensor("w.wq").shape) == [2 * 6 * 2 * 32], f.get_tensor("w.wq").shape
    assert list(f.get_tensor("w.gate").shape) == [20 * 32]
PY
"$TALON" train "${args[@]}" --max-steps 2 --data "$WORK/feat" --out "$WORK/sized" > /dev/null 2> "$WORK/r0.err"
[ $? -ne 0 ] && grep -q "belongs to a different training job (draft_shape" "$WORK/r0.err" \
  && ok "resuming with other draft sizes refused" || bad "resume with other sizes: $(tail -2 "$WORK/r0.err")"
"$TALON" train "${args[@]}" --max-steps 1 --draft-heads 3 --draft-kv-heads 2 --data "$WORK/feat" --out "$WORK/r1" > /dev/null 2> "$WORK/r1.err"
[ $? -ne 0 ] && grep -q "the heads must be a multiple of the kv heads" "$WORK/r1.err" && [ ! -e "$WORK/r1/checkpoint.safetensors" ] \
  && ok "heads not a multiple of kv heads refused" || bad "$(tail -2 "$WORK/r1.err")"
"$TALON" train "${args[@]}" --max-steps 1 --draft-head-dim 5 --data "$WORK/feat" --out "$WORK/r2" > /dev/null 2> "$WORK/r2.err"
[ $? -ne 0 ] && grep -q "draft-head-dim 5: RoPE needs an even head size" "$WORK/r2.err" && ok "odd head size refused" \
  || bad "$(tail -2 "$WORK/r2.err")"
"$TALON" train "${args[@]}" --max-steps 1 --draft-intermediate -4 --data "$WORK/feat" --out "$WORK/r3" > /dev/null 2> "$WORK/r3.err"
[ $? -ne 0 ] && grep -q "draft-intermediate -4: expected a positive size" "$WORK/r3.err" && ok "negative size refused" \
  || bad "$(tail -2 "$WORK/r3.err")"
finish
