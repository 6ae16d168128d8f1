// Helpers of the CUDA op harness (tests/backend/test_cuda_*.cpp): guarded device buffers
// (sentinels on both sides catch out-of-bounds writes), bf16-representable random inputs and
// conversions. Only for builds with the CUDA backend.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "util/dtype.h"

namespace talon::testing {

inline constexpr size_t kGuard = 64;
inline constexpr uint16_t kSentinel = 0x7fa1;  // a NaN pattern no op writes

// A device buffer of n elements with kGuard sentinel elements on both sides.
template <typename T>
struct Guarded {
  size_t n;
  T* base = nullptr;
  explicit Guarded(size_t n_) : n(n_) {
    cudaMalloc(&base, (n + 2 * kGuard) * sizeof(T));
    std::vector<uint16_t> fill((n + 2 * kGuard) * sizeof(T) / 2, kSentinel);
    cudaMemcpy(base, fill.data(), fill.size() * 2, cudaMemcpyHostToDevice);
  }
  ~Guarded() { cudaFree(base); }
  T* ptr() { return base + kGuard; }
  void upload(const std::vector<T>& v) { cudaMemcpy(ptr(), v.data(), n * sizeof(T), cudaMemcpyHostToDevice); }
  std::vector<T> download() {
    std::vector<T> v(n);
    cudaMemcpy(v.data(), ptr(), n * sizeof(T), cudaMemcpyDeviceToHost);
    return v;
  }
  bool guards_intact() {
    std::vector<uint16_t> g(kGuard * sizeof(T) / 2);
    for (T* p : {base, base + kGuard + n}) {
      cudaMemcpy(g.data(), p, kGuard * sizeof(T), cudaMemcpyDeviceToHost);
      for (auto x : g)
        if (x != kSentinel) return false;
    }
    return true;
  }
};

inline std::vector<float> randn(size_t n, uint32_t seed, float scale = 1.f) {
  std::mt19937 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(d(g)));  // representable in bf16
  return v;
}
inline std::vector<__nv_bfloat16> to_bf16(const std::vector<float>& v) {
  std::vector<__nv_bfloat16> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b = f32_to_bf16(v[i]);
    std::memcpy(static_cast<void*>(&o[i]), &b, 2);
  }
  return o;
}
inline std::vector<float> to_f32(const std::vector<__nv_bfloat16>& v) {
  std::vector<float> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, &v[i], 2);
    o[i] = bf16_to_f32(b);
  }
  return o;
}
inline bool all_finite(const std::vector<float>& v) {
  for (float x : v)
    if (!std::isfinite(x)) return false;
  return true;
}

}  // namespace talon::testing
