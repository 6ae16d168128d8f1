// Linked when the build has no CUDA compiler: the drafter's GPU entry points refuse.
#include "draft/draft_backend.h"
#include "draft/draft_gpu.h"
#include "util/error.h"

namespace talon::eagle3 {
std::unique_ptr<GpuDraftTrainer> make_gpu_draft_trainer(const DraftConfig&, const TargetHead&, const DraftVocab&,
                                                        const std::vector<int>&, GpuMath, int64_t, const GpuGroup&,
                                                        const GpuDraftOptions&, const GpuFamily&) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured): train with --device cpu");
}
std::string nccl_unique_id() { fail("this build has no CUDA backend: NCCL is not available"); }
std::unique_ptr<ProcessGroup> nccl_process_group(const RankInfo&, int, const fs::path&) {
  fail("this build has no CUDA backend: a GPU job across processes is not available");
}
std::shared_ptr<float[]> host_floats(size_t n, bool) { return std::shared_ptr<float[]>(new float[n]); }
}  // namespace talon::eagle3

namespace talon::spec {
std::unique_ptr<DraftBackend> make_cuda_draft_backend(const DraftModel&, const Checkpoint&, int, int64_t) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured): run the draft with --device cpu");
}
std::unique_ptr<DFlashBackend> make_cuda_dflash_backend(const DraftModel&, const Checkpoint&, int, int64_t) {
  fail("this build has no CUDA backend (nvcc was not found when it was configured): run the draft with --device cpu");
}
}  // namespace talon::spec
