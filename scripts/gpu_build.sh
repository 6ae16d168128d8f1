#!/usr/bin/env bash
# Build on a GPU machine that has the CUDA toolkit but no -dev packages: the header-only
# and static dependencies come from .deps/ (made by scripts/pack_deps.sh on a machine
# that has them), NCCL's header from the pip wheel PyTorch ships with, if any.
# Environment: TARGETS (ninja targets; default: talon, the tests and the GPU benchmarks).
set -euo pipefail
cd "$(dirname "$0")/.."
targets=${TARGETS:-talon talon_tests talon_bench_train talon_bench_decode talon_bench_moe talon_bench_deepseek talon_bench_attention}
nccl=$(python3 -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null || true)
# cuDNN (fused attention, loaded at run time) and the CUDA runtime its frontend loads: from
# PyTorch's wheels where they are, else the toolkit's.
sp=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)
cudnn_so=$(find ${sp:+"$sp/nvidia"} -name 'libcudnn.so.9' 2>/dev/null | head -1 || true)
cudnn_dir=${cudnn_so:+$(dirname "$(dirname "$cudnn_so")")}
cudart_so=$(find ${sp:+"$sp/nvidia"} /usr/local/cuda/lib64 -name 'libcudart.so.13*' 2>/dev/null | head -1 || true)
cupti_so=$(find /usr/local/cuda/extras/CUPTI/lib64 /usr/local/cuda/lib64 ${sp:+"$sp/nvidia"} -name 'libcupti.so.13*' 2>/dev/null | head -1 || true)
cmake -S . -B build -G Ninja -DTALON_DEPS_DIR="$PWD/.deps" -DTALON_NATIVE=OFF -DCMAKE_BUILD_TYPE=Release \
  ${nccl:+-DTALON_NCCL_DIR="$nccl"} ${cudnn_dir:+-DTALON_CUDNN_DIR="$cudnn_dir"} -Wno-dev > build.log 2>&1 ||
  { tail -30 build.log; exit 1; }
ninja -C build $targets >> build.log 2>&1 || { grep -E "error" -A3 build.log | head -40; exit 1; }
grep -E "talon: " build.log || true
# The runtime half of NCCL, for --tp > 1 (dlopen'ed by talon).
libs=${nccl:+$nccl/lib}
for so in "$cudnn_so" "$cudart_so" "$cupti_so"; do [ -n "$so" ] && libs=${libs:+$libs:}$(dirname "$so"); done
if [ -n "$libs" ]; then echo "export LD_LIBRARY_PATH=$libs:\${LD_LIBRARY_PATH:-}" > build/env.sh; else : > build/env.sh; fi
cat build/env.sh
