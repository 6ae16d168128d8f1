#include "draft/batch_tokens.h"

#include "util/error.h"

namespace talon {

void batch_tokens(const int32_t* ids, int64_t N, int64_t V, std::vector<int32_t>& slot, BatchTokens& out) {
  TALON_CHECK(V > 0 && int64_t(slot.size()) == V, "batch_tokens: scratch of {} entries for a vocabulary of {}",
              slot.size(), V);
  for (int64_t n = 0; n < N; ++n)
    TALON_CHECK(ids[n] >= 0 && ids[n] < V, "draft batch: token id {} at row {} is outside the vocabulary of {}", ids[n],
                n, V);
  out.toks.assign(1, 0);
  out.index.resize(size_t(N));
  slot[0] = 0;
  for (int64_t n = 0; n < N; ++n) {
    int32_t& s = slot[size_t(ids[n])];
    if (s < 0) {
      s = int32_t(out.toks.size());
      out.toks.push_back(ids[n]);
    }
    out.index[size_t(n)] = s;
  }
  for (int32_t t : out.toks) slot[size_t(t)] = -1;
}

}  // namespace talon
