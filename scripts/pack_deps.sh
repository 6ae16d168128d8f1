#!/usr/bin/env bash
# Packs the headers and static C libraries Talon builds against into .deps/, so the
# project can be built on a machine without the Debian -dev packages (e.g. a GPU host
# with only CUDA, CMake and a compiler): cmake -DTALON_DEPS_DIR=$PWD/.deps ...
set -euo pipefail
cd "$(dirname "$0")/.."
d=.deps
rm -rf "$d"; mkdir -p "$d/include" "$d/lib"
for h in nlohmann CLI spdlog fmt openssl pcre2.h utf8proc.h csv.h; do cp -r "/usr/include/$h" "$d/include/"; done
cp /usr/include/x86_64-linux-gnu/openssl/*.h "$d/include/openssl/"
for l in libcrypto.a libpcre2-8.a libutf8proc.a libcsv.a; do cp "/usr/lib/x86_64-linux-gnu/$l" "$d/lib/"; done
cp -r /usr/src/googletest "$d/googletest"
# The cuDNN frontend's headers and cuDNN's own (the GPU build prefers the headers of the cuDNN
# wheel it runs with, where it finds one).
scripts/fetch_cudnn_frontend.sh
mkdir -p "$d/cudnn-frontend" "$d/cudnn/include"
cp -r .cache/cudnn-frontend-1.32.0/include "$d/cudnn-frontend/"
scripts/fetch_cutlass.sh
mkdir -p "$d/cutlass"
cp -r .cache/cutlass-4.2.0.0/include "$d/cutlass/"
cudnn_h=$(dirname "$(find /usr/local/cuda/include /usr/include -maxdepth 2 -name cudnn.h 2>/dev/null | head -1)")
cp "$cudnn_h"/cudnn*.h "$d/cudnn/include/"
# CUPTI's headers (talon_bench_* --trace), where the GPU machine's toolkit lacks them.
cupti_h=$(dirname "$(find /usr/local/cuda/include /usr/local/cuda/extras/CUPTI/include -maxdepth 1 -name cupti.h 2>/dev/null | head -1)")
mkdir -p "$d/cupti/include" && cp "$cupti_h"/cupti*.h "$d/cupti/include/"
du -sh "$d"
