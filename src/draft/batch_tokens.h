// The distinct tokens of a training batch, for uploading only their embedding rows
// (--gpu-batch-embeddings, draft/cuda/draft_train.cu).
#pragma once
#include <cstdint>
#include <vector>

namespace talon {

struct BatchTokens {
  std::vector<int32_t> toks;   // distinct ids, token 0 first, then in order of first appearance
  std::vector<int32_t> index;  // [N]: row n's id is toks[index[n]]
};

// Fills `out` for ids[0..N). Every id must lie in [0, V) (throws talon::Error naming the first
// row that does not, before anything is changed). `slot` is scratch of V entries, all -1 on entry
// and again on return.
void batch_tokens(const int32_t* ids, int64_t N, int64_t V, std::vector<int32_t>& slot, BatchTokens& out);

}  // namespace talon
