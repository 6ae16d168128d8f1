#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan) and runs each one.
#   scripts/fuzz.sh smoke        ~20 s per target (CI)
#   scripts/fuzz.sh SECONDS      longer runs; crashes land in build-fuzz/crashes/
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-smoke}
[ "$secs" = smoke ] && secs=20
CC=clang CXX=clang++ cmake -S . -B build-fuzz -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTALON_FUZZ=ON -DTALON_TESTS=OFF \
  -DTALON_NATIVE=OFF -DTALON_CUDA=OFF > /dev/null
cmake --build build-fuzz -j"$(nproc)" --target fuzz_gguf fuzz_safetensors fuzz_json > /dev/null
mkdir -p build-fuzz/crashes build-fuzz/corpus/{gguf,safetensors,json}
cp tests/fixtures/gguf/*.gguf build-fuzz/corpus/gguf/ 2>/dev/null || true
for f in tests/fixtures/golden/*/golden.safetensors tests/fixtures/golden/mistral/model.safetensors; do
  cp "$f" "build-fuzz/corpus/safetensors/$(echo "$f" | tr / _)"
done
for f in tests/fixtures/golden/*/config.json; do cp "$f" "build-fuzz/corpus/json/$(echo "$f" | tr / _)"; done
head -3 examples/demo_tokens.jsonl > build-fuzz/corpus/json/demo.jsonl
status=0
for t in gguf safetensors json; do
  echo "fuzz: $t for ${secs}s"
  if ! ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1 build-fuzz/tests/fuzz/fuzz_$t \
      -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -print_final_stats=1 \
      -artifact_prefix=build-fuzz/crashes/$t- build-fuzz/corpus/$t > build-fuzz/fuzz_$t.log 2>&1; then
    echo "fuzz: $t FAILED (see build-fuzz/fuzz_$t.log)"; tail -30 build-fuzz/fuzz_$t.log; status=1
  else
    grep -E "stat::number_of_executed_units|cov:" build-fuzz/fuzz_$t.log | tail -2
  fi
done
exit $status
