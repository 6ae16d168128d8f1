// The CUDA cached decoder (model/decode.h).
#include "model/decode.h"
#include "util/error.h"

namespace talon {
std::unique_ptr<Decoder> make_cuda_decoder(const Checkpoint&, int, int, int64_t) {
  fail("the CUDA decoder is not available in this build yet: use --device cpu");
}
}  // namespace talon
