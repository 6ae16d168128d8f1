#!/usr/bin/env bash
# The main job on the embedded default model: set up, build, fetch SmolLM2-135M-Instruct,
# extract EAGLE-3 features for the built-in demo conversations, and summarise them.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh > /dev/null
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j"$(nproc)" --target talon > /dev/null
model=$(scripts/fetch_model.sh)
out=${1:-out/demo}
rm -rf "$out/tokens"   # prepare is cheap; extract below resumes or is a no-op if already done
build/talon prepare --model "$model" --data examples/demo_chats.jsonl --out "$out/tokens"
build/talon inspect "$out/tokens" --sample 0
build/talon extract --model "$model" --data "$out/tokens" --out "$out/features" --device cpu
build/talon inspect "$out/features"
echo "demo: tokens in $out/tokens, features in $out/features (read them with the Python snippet in README.md)"
