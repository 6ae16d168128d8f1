#!/usr/bin/env bash
# Fetches CUTLASS's headers (header-only C++ templates; PyPI package nvidia-cutlass, pinned) into
# .cache/cutlass-<version>/include, where CMake looks for them. The CUDA build uses them for the
# Hopper (wgmma/TMA) grouped GEMM of the MoE experts (TALON_MOE_GEMM=cutlass). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=4.2.0.0
dst=.cache/cutlass-$ver
[ -f "$dst/include/cutlass/util/packed_stride.hpp" ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps "nvidia-cutlass==$ver" -d "$tmp" ||
  { echo "fetch_cutlass: could not download nvidia-cutlass==$ver from PyPI" >&2; exit 1; }
whl=$(ls "$tmp"/nvidia_cutlass-*.whl | head -1)
python3 - "$whl" "$tmp/x" <<'PY'
import sys, zipfile
pres = ("cutlass_library/source/include/", "cutlass_library/source/tools/util/include/")
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith(pres)])
PY
src="$tmp/x/cutlass_library/source/include"
[ -f "$src/cutlass/cutlass.h" ] && [ -f "$src/cute/tensor.hpp" ] ||
  { echo "fetch_cutlass: $whl has no cutlass/cutlass.h and cute/tensor.hpp" >&2; exit 1; }
# The utilities (cutlass/util: packed strides) go beside the library's own headers.
cp -r "$tmp/x/cutlass_library/source/tools/util/include/cutlass/util" "$src/cutlass/"
mkdir -p .cache
rm -rf "$dst.tmp"; mkdir -p "$dst.tmp"; mv "$src" "$dst.tmp/include"
rm -rf "$dst"; mv "$dst.tmp" "$dst"
echo "fetch_cutlass: CUTLASS $ver headers in $dst/include"
