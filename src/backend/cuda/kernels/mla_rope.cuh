// MLA's RoPE pairing of the rope part (deepseek_ops.cu's packed forward and mla_decode.cu's
// cached decoder): element j of a rope vector pairs with another and both use the angle of
// pair p, either adjacent elements (interleaved, DeepSeek's own layout) or (i, i + rope / 2)
// (rotate_half). The rotation of element j is first ? a c - b s : b c + a s with a, b the
// pair's elements at ia, ib.
#pragma once

namespace talon::cuda {

struct MlaRopePair {
  int p, ia, ib;
  bool first;
};

__device__ __forceinline__ MlaRopePair mla_rope_pair(int j, int rope, bool interleaved) {
  if (interleaved) return {j / 2, 2 * (j / 2), 2 * (j / 2) + 1, (j % 2) == 0};
  const int half = rope / 2, p = j % half;
  return {p, p, p + half, j < half};
}

}  // namespace talon::cuda
