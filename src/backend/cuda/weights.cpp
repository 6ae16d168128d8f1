// The bf16 weight upload shared by the CUDA model and the cached decoder (weights.h).
#include "backend/cuda/weights.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <thread>

#include "model/dense.h"
#include "model/model.h"
#include "util/threads.h"
#include "util/error.h"
#include "util/log.h"

namespace talon::cuda {

namespace {

// A rectangular block [row0, row0 + rows) x [col0, col0 + cols) of a weight viewed as
// [R, C] (1-D weights are [1, n]), copied to contiguous device memory.
struct Part {
  bf16* dst;
  const WeightRef* src;
  int64_t row0, rows, col0, cols;
};

int64_t dim_r(const WeightRef& w) { return w.shape.size() == 2 ? w.shape[0] : 1; }
int64_t dim_c(const WeightRef& w) { return w.shape.empty() ? 0 : w.shape.back(); }

void upload_part(const Part& p, std::vector<float>& f32, std::vector<uint16_t>& b16) {
  const WeightRef& r = *p.src;
  const int64_t C = dim_c(r);
  if (r.dtype == DType::BF16) {
    const auto* base = static_cast<const uint16_t*>(r.data) + p.row0 * C + p.col0;
    if (p.cols == C)
      CUDA_CHECK(cudaMemcpy(p.dst, base, size_t(p.rows * p.cols) * 2, cudaMemcpyHostToDevice));
    else
      CUDA_CHECK(cudaMemcpy2D(p.dst, size_t(p.cols) * 2, base, size_t(C) * 2, size_t(p.cols) * 2, size_t(p.rows),
                              cudaMemcpyHostToDevice));
    return;
  }
  // Other stored types: convert one row at a time on the host.
  const size_t esz = dtype_size(r.dtype);
  b16.resize(size_t(p.rows * p.cols));
  f32.resize(size_t(p.cols));
  for (int64_t i = 0; i < p.rows; ++i) {
    const auto* row = static_cast<const uint8_t*>(r.data) + size_t((p.row0 + i) * C + p.col0) * esz;
    convert_to_f32(r.dtype, row, f32.data(), size_t(p.cols));
    for (int64_t j = 0; j < p.cols; ++j) b16[size_t(i * p.cols + j)] = talon::f32_to_bf16(f32[size_t(j)]);
  }
  CUDA_CHECK(cudaMemcpy(p.dst, b16.data(), b16.size() * 2, cudaMemcpyHostToDevice));
}

}  // namespace

void copy_bf16(bf16* dst, const float* src, size_t n) {
  std::vector<uint16_t> b(n);
  for (size_t i = 0; i < n; ++i) b[i] = talon::f32_to_bf16(src[i]);
  CUDA_CHECK(cudaMemcpy(dst, b.data(), n * 2, cudaMemcpyHostToDevice));
}

bf16* upload_bf16(DeviceArena& arena, std::initializer_list<const std::vector<float>*> parts) {
  size_t n = 0;
  for (const auto* p : parts) n += p->size();
  bf16* d = arena.alloc<bf16>(n);
  size_t at = 0;
  for (const auto* p : parts) {
    copy_bf16(d + at, p->data(), p->size());
    at += p->size();
  }
  return d;
}

bf16* upload_weight(const WeightRef& w, DeviceArena& arena) {
  const Part p{arena.alloc<bf16>(size_t(dim_r(w) * dim_c(w))), &w, 0, dim_r(w), 0, dim_c(w)};
  std::vector<float> f32;
  std::vector<uint16_t> b16;
  upload_part(p, f32, b16);
  return p.dst;
}

DenseDeviceWeights upload_dense_weights(const Checkpoint& ckpt, int device, int rk, int tp, DeviceArena& arena) {
  const ModelConfig& c = ckpt.config();
  DenseDeviceWeights d;
  d.nh = c.n_heads / tp;
  d.nkv = c.n_kv_heads / tp;
  d.inter = c.intermediate / tp;
  DenseWeights w = bind_dense_weights(ckpt);
  // Plan every upload first (fused q|k|v and gate|up are adjacent parts of one
  // allocation; tensor-parallel slices are row or column blocks), then copy with a
  // pool of threads straight from the mapped file.
  std::vector<Part> parts;
  int64_t total_bytes = 0;
  struct Piece {
    const WeightRef* w;
    int64_t row0, rows, col0, cols;
  };
  auto up = [&](std::initializer_list<Piece> pieces) {
    int64_t n = 0;
    for (auto& p : pieces)
      if (p.w->data) n += p.rows * p.cols;
    if (n == 0) return static_cast<bf16*>(nullptr);
    bf16* dst = arena.alloc<bf16>(size_t(n));
    int64_t off = 0;
    for (auto& p : pieces)
      if (p.w->data) {
        parts.push_back({dst + off, p.w, p.row0, p.rows, p.col0, p.cols});
        off += p.rows * p.cols;
      }
    total_bytes += n * 2;
    return dst;
  };
  auto whole = [](const WeightRef& r) { return Piece{&r, 0, dim_r(r), 0, dim_c(r)}; };
  auto rows = [&](const WeightRef& r, int64_t per) { return Piece{&r, rk * per, per, 0, dim_c(r)}; };
  auto cols = [&](const WeightRef& r, int64_t per) { return Piece{&r, 0, dim_r(r), rk * per, per}; };
  const int64_t hd = c.head_dim, qd = d.nh * hd, kvd = d.nkv * hd;
  d.embed = up({whole(w.embed)});
  d.lm_head = c.tied_embeddings ? d.embed : up({whole(w.lm_head)});
  d.final_norm = up({whole(w.final_norm)});
  for (auto& l : w.layers) {
    DenseLayerDev L;
    L.attn_norm = up({whole(l.attn_norm)});
    L.mlp_norm = up({whole(l.mlp_norm)});
    L.wqkv = up({rows(l.wq, qd), rows(l.wk, kvd), rows(l.wv, kvd)});
    if (c.qkv_bias) L.bqkv = up({cols(l.bq, qd), cols(l.bk, kvd), cols(l.bv, kvd)});
    if (c.qk_norm) {
      L.q_norm = up({whole(l.q_norm)});
      L.k_norm = up({whole(l.k_norm)});
    }
    L.wo = up({cols(l.wo, qd)});
    L.wgu = up({rows(l.w_gate, d.inter), rows(l.w_up, d.inter)});
    L.wdown = up({cols(l.w_down, d.inter)});
    d.layers.push_back(L);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::atomic<size_t> next{0};
  const int n_threads = int(std::clamp<unsigned>(std::thread::hardware_concurrency() / unsigned(tp), 1, 8));
  run_threads(n_threads, [&](int) {
    CUDA_CHECK(cudaSetDevice(device));
    std::vector<float> f32;
    std::vector<uint16_t> b16;
    for (size_t i; (i = next++) < parts.size();) upload_part(parts[i], f32, b16);
  });
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  tlog::info("cuda:{}: uploaded {:.2f} GB of bf16 weights{} in {:.2f}s ({:.1f} GB/s, {} threads)", device,
             double(total_bytes) / 1e9, tp > 1 ? fmt::format(" (tp rank {}/{})", rk, tp) : "", secs,
             secs > 0 ? double(total_bytes) / 1e9 / secs : 0.0, n_threads);
  auto inv = rope_inv_freq(c.rope, c.head_dim);
  d.inv_freq = arena.alloc<float>(inv.size());
  CUDA_CHECK(cudaMemcpy(d.inv_freq, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
  d.weight_bytes = total_bytes;
  return d;
}

}  // namespace talon::cuda
