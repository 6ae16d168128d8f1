// Linked when the build has no CUDA compiler.
#include "backend/backend.h"
#include "util/error.h"

namespace talon {
bool cuda_backend_built() { return false; }
std::unique_ptr<Model> make_cuda_model(const Checkpoint&, int) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured)");
}
std::unique_ptr<Model> make_cuda_model(const Checkpoint&, const GpuOptions&) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured)");
}
std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint&, int, int, int64_t, int64_t) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured): use --device cpu");
}
std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint&, const GpuOptions&, int, int64_t, int64_t) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured): use --device cpu");
}
std::unique_ptr<Model> make_cuda_deepseek_model(const Checkpoint&, int) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured)");
}
std::vector<GpuInfo> list_gpus() { return {}; }
}  // namespace talon
