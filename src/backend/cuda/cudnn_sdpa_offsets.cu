// The ragged offsets and lengths cuDNN's fused attention reads (see cudnn_sdpa.h).
#include "backend/cuda/check.h"
#include "backend/cuda/cudnn_sdpa.h"

namespace talon::cuda {
namespace {

__global__ void ragged_offsets_kernel(int32_t* off, int32_t* len, const int64_t* seq_start, int n_b, int nb_pad,
                                      int64_t per_row) {
  const int b = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (b > nb_pad) return;
  const int64_t r = seq_start[b < n_b ? b : n_b];
  off[b] = int32_t(r * per_row);
  if (len && b < nb_pad) len[b] = b < n_b ? int32_t(seq_start[b + 1] - r) : 0;
}

}  // namespace

void sdpa_ragged_offsets(int32_t* off, int32_t* len, const int64_t* seq_start_d, int n_b, int nb_pad,
                         int64_t per_row, cudaStream_t s) {
  const int n = nb_pad + 1;
  ragged_offsets_kernel<<<(n + 127) / 128, 128, 0, s>>>(off, len, seq_start_d, n_b, nb_pad, per_row);
  CUDA_LAUNCH_CHECK();
}

}  // namespace talon::cuda
