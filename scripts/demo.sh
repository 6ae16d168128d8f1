#!/usr/bin/env bash
# The main job on the embedded default model: set up, build, fetch SmolLM2-135M-Instruct,
# extract EAGLE-3 features for the built-in demo conversations, and summarise them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh > /dev/null
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j"$(nproc)" --target talon > /dev/null
model=$(scripts/fetch_model.sh)
out=${1:-out/demo-features}
build/talon extract --model "$model" --data examples/demo_tokens.jsonl --out "$out" --device cpu
build/talon inspect "$out" --sample 0
echo "demo: features are in $out (read them with the Python snippet in README.md)"
