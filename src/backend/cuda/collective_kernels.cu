// Device half of the shared-device collectives (collective.h): ops.h accumulate.
#include <string>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"

namespace talon::cuda {

namespace {
template <typename T>
__global__ void accumulate_kernel(T* dst, const T* src, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if constexpr (sizeof(T) == 2)
      dst[i] = __float2bfloat16(__bfloat162float(dst[i]) + __bfloat162float(src[i]));
    else
      dst[i] += src[i];
  }
}
}  // namespace

void accumulate(void* dst, const void* src, int64_t n, bool is_bf16, cudaStream_t s) {
  if (n <= 0) return;
  const unsigned blocks = unsigned(std::min<int64_t>((n + 255) / 256, 4096));
  if (is_bf16)
    accumulate_kernel<<<blocks, 256, 0, s>>>(static_cast<bf16*>(dst), static_cast<const bf16*>(src), n);
  else
    accumulate_kernel<<<blocks, 256, 0, s>>>(static_cast<float*>(dst), static_cast<const float*>(src), n);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
