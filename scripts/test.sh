#!/usr/bin/env bash
# Builds everything (CUDA code too when nvcc is present) and runs the whole CPU test
# suite: unit + golden parity tests, CLI scenarios (fault injection included), a short
# fuzzing smoke run of every target, and the suite again under ASan+UBSan and TSan.
# TALON_SKIP_SANITIZE=1 leaves out the sanitizer builds (for a quick local run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh > /dev/null
export TALON_REQUIRE_MODEL=1
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j"$(nproc)"
ctest --test-dir build --output-on-failure -j"$(nproc)"
scripts/fuzz.sh smoke
[ "${TALON_SKIP_SANITIZE:-0}" = 1 ] || scripts/sanitize.sh
