#!/usr/bin/env bash
# The test command, in two tiers:
#   scripts/test.sh          installs what the tests need, builds (CUDA code too when nvcc is
#                            present) and runs the whole Release suite: unit + golden parity
#                            tests, CLI scenarios (fault injection and multi-process training
#                            included). Minutes on a 2-core machine; see docs/reliability.md.
#   scripts/test.sh --full   the same, then a short fuzzing run of every fuzz target and the
#                            suite again under ASan+UBSan and under TSan. This is what CI runs
#                            (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
full=0
for a in "$@"; do
  case "$a" in
    --full) full=1 ;;
    -h|--help) sed -n '2,9p' "$0"; exit 0 ;;
    *) echo "scripts/test.sh: unknown argument '$a' (expected --full)" >&2; exit 2 ;;
  esac
done
scripts/setup.sh --tests > /dev/null
# The full tier's Release suite runs the long variants too (tokenizer parity on the whole corpus).
[ "$full" = 1 ] && export TALON_TEST_FULL=1
export TALON_REQUIRE_MODEL=1
t0=$(date +%s)
werror=OFF
[ "$full" = 1 ] && werror=ON  # CI: a warning fails the build
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DTALON_WERROR=$werror > /dev/null
cmake --build build -j"$(nproc)"
t1=$(date +%s)
ctest --test-dir build --output-on-failure -j"$(nproc)"
t2=$(date +%s)
echo "test: build $((t1 - t0)) s, Release suite $((t2 - t1)) s"
[ "$full" = 1 ] || exit 0
scripts/fuzz.sh smoke
t3=$(date +%s)
[ "${TALON_SKIP_SANITIZE:-0}" = 1 ] || scripts/sanitize.sh
t4=$(date +%s)
echo "test --full: build $((t1 - t0)) s, Release suite $((t2 - t1)) s, fuzz $((t3 - t2)) s, sanitizers $((t4 - t3)) s"
