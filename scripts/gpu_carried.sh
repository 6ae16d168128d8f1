#!/usr/bin/env bash
# Source this on a GPU machine to use binaries built on the CPU machine instead of building there
# (saves the 2-3 minute device build). On the CPU machine: build the targets (sm_90a is always in
# the CUDA flags), then pack them with their non-CUDA shared libraries:
#   mkdir -p /tmp/bin/lib /tmp/bin/build/tests && cp build/tests/talon_tests /tmp/bin/build/tests/ &&
#   cp build/talon_bench_moe /tmp/bin/build/ && for l in $(ldd build/tests/talon_tests |
#   awk '/=> \/(usr\/)?lib/ {print $3}' | grep -v 'libc\.\|libm\.\|libstdc\|libgcc\|ld-linux\|librt\|libpthread\|libdl\.'); do
#   cp -L "$l" /tmp/bin/lib/; done && tar czf .gpucarry/bin.tgz -C /tmp/bin .
# and carry .gpucarry/bin.tgz (and .gpucarry/deps.tgz for the fallback) with the call:
#   source scripts/gpu_carried.sh; build/tests/talon_tests ...
# If the carried binary does not start there, it builds with scripts/gpu_build.sh instead.
tar xzf .gpucarry/bin.tgz -C . 2>/dev/null
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null)
export LD_LIBRARY_PATH=$PWD/lib:/usr/local/cuda/lib64:$(ls -d "$sp"/nvidia/*/lib 2>/dev/null | tr '\n' ':')${LD_LIBRARY_PATH:-}
if ! build/tests/talon_tests --gtest_list_tests > /dev/null 2>&1; then
  echo "gpu_carried: the carried binaries do not run here; building with scripts/gpu_build.sh"
  tar xzf .gpucarry/deps.tgz && TARGETS="${TARGETS:-talon_tests talon_bench_moe}" bash scripts/gpu_build.sh > "${OUT:-/tmp}/build.txt" 2>&1
  tail -3 "${OUT:-/tmp}/build.txt"; source build/env.sh
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
