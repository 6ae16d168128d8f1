#!/usr/bin/env bash
# Installs what Talon needs on Debian/Ubuntu (run as root or with sudo) and fetches the
# embedded default model. Idempotent.
#   scripts/setup.sh           what building and running talon needs (the demo's setup)
#   scripts/setup.sh --tests   also what the test suite needs: clang for the fuzzers, Open MPI
#                              for multi-process training, the Python oracles (tokenizers,
#                              transformers, PyTorch CPU). scripts/test.sh runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
tests=0
for a in "$@"; do
  case "$a" in
    --tests) tests=1 ;;
    *) echo "setup: unknown argument '$a' (expected --tests)" >&2; exit 2 ;;
  esac
done

# libgtest-dev: the default configure also builds the test binary (TALON_TESTS).
pkgs=(cmake g++ make pkg-config nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev libgtest-dev
      libssl-dev libpcre2-dev libutf8proc-dev libcsv-dev python3 python3-pip unzip)
# chromium: headless screenshots of the HTML reports (tests/cli/check_charts.py).
[ "$tests" = 1 ] && pkgs+=(clang libclang-rt-dev libomp-dev openmpi-bin chromium)
missing=()
for p in "${pkgs[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
# The cuDNN frontend's and CUTLASS's headers, where a CUDA compiler is installed (the CUDA
# build's fused attention and grouped GEMM routes; see scripts/fetch_*.sh).
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  scripts/fetch_cudnn_frontend.sh
  scripts/fetch_cutlass.sh
fi
if [ "$tests" = 0 ]; then
  scripts/fetch_model.sh
  exit 0
fi
# Test oracles (reference tokenizers) from PyPI.
if ! python3 -c "import tokenizers, sentencepiece, google.protobuf, gguf, transformers" 2>/dev/null; then
  echo "setup: installing Python test oracles"
  pkgs_py=(tokenizers sentencepiece protobuf gguf transformers numpy safetensors)
  python3 -m pip install --quiet "${pkgs_py[@]}" ||
    python3 -m pip install --quiet --break-system-packages "${pkgs_py[@]}"
fi
# PyTorch (CPU wheel) for the export test's bf16 oracle (tests/cli/check_export.py).
# The CPU wheel index first (small); where that index cannot be reached, the default index.
pip_torch() {
  python3 -m pip install --quiet "$@" || python3 -m pip install --quiet --break-system-packages "$@"
}
if ! python3 -c "import torch" 2>/dev/null; then
  echo "setup: installing PyTorch (CPU)"
  pip_torch --retries 1 --timeout 30 torch --index-url https://download.pytorch.org/whl/cpu || {
    echo "setup: the PyTorch CPU index is unreachable; installing torch from the default index"
    pip_torch torch
  }
fi
# speculators 0.9.0 (vLLM's trainer) loads the P-EAGLE export with its own classes and schema
# (tests/cli/check_peagle_export.py). Its declared pins (torch <= 2.14.1, transformers <= 5.19)
# would replace the ones above, and it imports only part of what it declares: the package
# without dependencies, then what it imports.
if ! python3 -c "import speculators.models.peagle" 2>/dev/null; then
  echo "setup: installing speculators 0.9.0 (test oracle)"
  pip_torch --no-deps speculators==0.9.0
  pip_torch openai "datasets>=4.0.0,<=5.1.0" hs-connectors==0.9.0 "loguru>=0.7.2,<=0.7.3" pydantic pydantic-settings \
    typer rich psutil
fi
scripts/fetch_model.sh
