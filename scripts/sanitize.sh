#!/usr/bin/env bash
# The CPU test suite under sanitizers (no GPU needed), each in its own build directory:
#   asan  ASan + UBSan (build-asan): every unit test and CLI scenario but cli.train_mpi (MPI's own
#         allocations are outside this build) and those that run the
#         embedded model through prepare / extract / train many times (cli.resume, cli.ranks,
#         cli.train, cli.generate, cli.faults: each takes over 10 minutes under ASan on two
#         cores; cli.threads drives the same stop / kill / resume code with a tiny model, and
#         cli.bad_inputs the error paths; cli.faults itself runs in the Release suite) and the
#         Python-oracle and GPU ones (cli.tokenizer_parity, cli.gpu_extract)
#   tsan  ThreadSanitizer (build-tsan): the threaded code, through tests/cli/threads.sh:
#         extract's loader / compute / allocator / writer threads over many shards (stopped,
#         killed and resumed, two concurrent ranks) and the tokenize thread pool. OpenMP
#         loops run serially in this build (TALON_TSAN: libgomp is not instrumented).
#   scripts/sanitize.sh [asan|tsan|all]     (default all)
# Sanitizer reports go to build-*/reports/ (ASan, TSan: log_path; UBSan, which GCC's
# runtime prints to stderr only: copied there from every CLI test's captured output and from
# the ctest log); any report fails the run, even from a run a test expected to fail.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
jobs=$(nproc)
export TALON_REQUIRE_MODEL=${TALON_REQUIRE_MODEL:-1}
# -O1 with line tables only (-g1): compiles in about half the time of -O2 -g, and the
# reports still name file and line; the build, not the tests, is most of this stage.
# Unity builds (several sources of a library compiled as one) roughly halve these builds'
# compile time on two cores; the Release build, which compiles every source on its own, keeps
# each file honest about its includes.
common=(-DCMAKE_UNITY_BUILD=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
        "-DCMAKE_C_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG" -DTALON_NATIVE=OFF -DTALON_CUDA=OFF
        ${TALON_DEPS_DIR:+-DTALON_DEPS_DIR=$TALON_DEPS_DIR})
status=0

# reports DIR NAME: prints and counts the reports in DIR; fails the run when there are any.
reports() {
  local n
  n=$(find "$1" -type f 2>/dev/null | wc -l)
  if [ "$n" -gt 0 ]; then
    echo "sanitize: $2: $n report(s):"
    for f in $(find "$1" -type f | head -5); do echo "== $f"; head -40 "$f"; done
    status=1
  else
    echo "sanitize: $2: no reports"
  fi
}

if [ "$what" = asan ] || [ "$what" = all ]; then
  t0=$(date +%s)
  cmake -S . -B build-asan "${common[@]}" -DTALON_SANITIZE=ON > /dev/null
  cmake --build build-asan -j"$jobs" --target talon talon_tests talon_enospc > build-asan.log 2>&1 ||
    { tail -30 build-asan.log; exit 1; }
  rm -rf build-asan/reports && mkdir -p build-asan/reports
  r=$PWD/build-asan/reports
  # detect_leaks: leaks count; the CLI scenarios run talon many times, each one checked.
  TALON_SANITIZER_REPORTS=$r ASAN_OPTIONS=detect_leaks=1:halt_on_error=1:log_path=$r/asan:strict_string_checks=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$r/ubsan \
    ctest --test-dir build-asan --output-on-failure -j"$jobs" -E "${SANITIZE_EXCLUDE:-cli.tokenizer_parity|cli.gpu_extract|cli.resume|cli.ranks|cli.train|cli.train_mpi|cli.generate|cli.faults}" \
    > build-asan/ctest.log 2>&1 || { echo "sanitize: asan: tests failed"; grep -E "Failed|\*\*\*" build-asan/ctest.log | head -30; status=1; }
  grep -E "tests passed|tests failed" build-asan/ctest.log || true
  grep -E "runtime error:|ERROR: (Address|Leak)Sanitizer" build-asan/ctest.log > "$r/from-ctest-log" || rm -f "$r/from-ctest-log"
  reports "$r" "ASan+UBSan"
  echo "sanitize: asan took $(( $(date +%s) - t0 )) s"
fi

if [ "$what" = tsan ] || [ "$what" = all ]; then
  t0=$(date +%s)
  cmake -S . -B build-tsan "${common[@]}" -DTALON_TSAN=ON > /dev/null
  cmake --build build-tsan -j"$jobs" --target talon > build-tsan.log 2>&1 ||
    { tail -30 build-tsan.log; exit 1; }
  rm -rf build-tsan/reports && mkdir -p build-tsan/reports
  r=$PWD/build-tsan/reports
  TALON_SANITIZER_REPORTS=$r TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:log_path=$r/tsan \
    bash tests/cli/threads.sh build-tsan/talon "$PWD" > build-tsan/threads.log 2>&1 ||
    { echo "sanitize: tsan: tests failed"; grep FAIL build-tsan/threads.log | head; status=1; }
  tail -1 build-tsan/threads.log
  reports "$r" "TSan"
  echo "sanitize: tsan took $(( $(date +%s) - t0 )) s"
fi
exit $status
