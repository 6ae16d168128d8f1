#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, ASan + UBSan; -O1 with line tables, quick to build)
# and runs each one.
#   scripts/fuzz.sh smoke                 ~15 s per target (CI), two targets at a time
#   scripts/fuzz.sh SECONDS [TARGET...]   longer runs; crashes land in build-fuzz/crashes/
# FUZZ_PARALLEL=N runs N targets at once. Seeds: tests/fuzz/corpus/<target>/ (committed) plus
# the test fixtures; the working corpus grows in build-fuzz/corpus/<target>/.
# Summary lines ("fuzz: TARGET execs N crashes 0 ...") go to build-fuzz/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-smoke}
smoke=0
[ "$secs" = smoke ] && secs=15 && smoke=1
shift || true
all=(gguf safetensors json tokenizer jinja dataset manifest export)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")
# Unity build: see scripts/sanitize.sh. Each fuzz target links only the layer it parses with.
CC=${FUZZ_CC:-clang} CXX=${FUZZ_CXX:-clang++} cmake -S . -B build-fuzz -DCMAKE_UNITY_BUILD=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DTALON_FUZZ=ON -DTALON_TESTS=OFF \
  -DTALON_NATIVE=OFF -DTALON_CUDA=OFF ${TALON_DEPS_DIR:+-DTALON_DEPS_DIR=$TALON_DEPS_DIR} > /dev/null
cmake --build build-fuzz -j"$(nproc)" --target $(printf 'fuzz_%s ' "${targets[@]}") > /dev/null
mkdir -p build-fuzz/crashes
for t in "${all[@]}"; do
  mkdir -p "build-fuzz/corpus/$t"
  [ -d "tests/fuzz/corpus/$t" ] && cp tests/fuzz/corpus/$t/* "build-fuzz/corpus/$t/"
done
cp tests/fixtures/gguf/*.gguf build-fuzz/corpus/gguf/ 2>/dev/null || true
for f in tests/fixtures/golden/*/golden.safetensors tests/fixtures/golden/mistral/model.safetensors; do
  cp "$f" "build-fuzz/corpus/safetensors/$(echo "$f" | tr / _)"
done
for f in tests/fixtures/golden/*/config.json; do cp "$f" "build-fuzz/corpus/json/$(echo "$f" | tr / _)"; done
head -3 examples/demo_tokens.jsonl > build-fuzz/corpus/json/demo.jsonl
cp tests/fixtures/tokenizers/*_tiny.json build-fuzz/corpus/tokenizer/
cp tests/fixtures/templates/*.jinja build-fuzz/corpus/jinja/
head -5 examples/demo_chats.jsonl > build-fuzz/corpus/dataset/demo.jsonl

run_one() {
  local t=$1 log=build-fuzz/fuzz_$1.log rc=0
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 build-fuzz/tests/fuzz/fuzz_$t \
    -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -timeout=25 -print_final_stats=1 \
    -artifact_prefix=build-fuzz/crashes/$t- build-fuzz/corpus/$t > "$log" 2>&1 || rc=$?
  local execs
  execs=$(grep -oE "stat::number_of_executed_units: *[0-9]+" "$log" | grep -oE "[0-9]+$" | tail -1)
  echo "fuzz: $t execs ${execs:-?} seconds $secs rc $rc corpus $(ls build-fuzz/corpus/$t | wc -l)" >> build-fuzz/summary.txt
  if [ $rc -ne 0 ]; then
    echo "fuzz: $t FAILED (see $log)"; tail -30 "$log"; return 1
  fi
  echo "fuzz: $t ok, ${execs:-?} executions in ${secs}s"
}
: > build-fuzz/summary.txt
status=0
par=${FUZZ_PARALLEL:-1}
# smoke: two targets at once (one per core of the 2-core CI machine; each is one process).
[ "$smoke" = 1 ] && par=${FUZZ_PARALLEL:-2}
pids=()
for t in "${targets[@]}"; do
  run_one "$t" &
  pids+=($!)
  if [ ${#pids[@]} -ge "$par" ]; then wait "${pids[0]}" || status=1; pids=("${pids[@]:1}"); fi
done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
