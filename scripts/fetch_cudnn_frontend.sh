#!/usr/bin/env bash
# Fetches the cuDNN frontend's headers (header-only C++; PyPI package nvidia-cudnn-frontend,
# pinned) into .cache/cudnn-frontend-<version>/include, where CMake looks for them. The CUDA
# build uses them for the fused attention route (--gpu-attention cudnn); cuDNN itself is
# loaded at run time, so nothing here is needed to run without it. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=1.32.0
dst=.cache/cudnn-frontend-$ver
[ -f "$dst/include/cudnn_frontend.h" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 --platform manylinux_2_28_x86_64 \
  "nvidia-cudnn-frontend==$ver" -d "$tmp" ||
  { echo "fetch_cudnn_frontend: could not download nvidia-cudnn-frontend==$ver from PyPI" >&2; exit 1; }
whl=$(ls "$tmp"/nvidia_cudnn_frontend-*.whl | head -1)
python3 - "$whl" "$tmp/x" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
[ -f "$tmp/x/include/cudnn_frontend.h" ] || { echo "fetch_cudnn_frontend: $whl has no include/cudnn_frontend.h" >&2; exit 1; }
mkdir -p .cache
rm -rf "$dst.tmp"; mkdir -p "$dst.tmp"; mv "$tmp/x/include" "$dst.tmp/include"
rm -rf "$dst"; mv "$dst.tmp" "$dst"
echo "fetch_cudnn_frontend: cuDNN frontend $ver headers in $dst/include"
