// The CUDA forward for the dense decoder family: same steps as the CPU reference
// (src/backend/cpu/cpu_model.cpp), bf16 weights/activations, fp32 residual stream.
// q|k|v and gate|up are fused into one GEMM each.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"
#include "model/dense.h"
#include "model/model.h"
#include "util/error.h"
#include "util/log.h"

namespace talon {

namespace {

using cuda::bf16;

// Owns device allocations; freed in reverse on destruction.
class DeviceArena {
 public:
  ~DeviceArena() {
    for (auto it = ptrs_.rbegin(); it != ptrs_.rend(); ++it) cudaFree(*it);
  }
  template <typename T>
  T* alloc(size_t n) {
    void* p = nullptr;
    if (n == 0) return nullptr;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    ptrs_.push_back(p);
    bytes_ += n * sizeof(T);
    return static_cast<T*>(p);
  }
  size_t bytes() const { return bytes_; }

 private:
  std::vector<void*> ptrs_;
  size_t bytes_ = 0;
};

int64_t numel(const WeightRef& w) {
  int64_t n = 1;
  for (auto d : w.shape) n *= d;
  return n;
}

// Host bf16 copy of a weight (a straight copy when it is stored as bf16).
void append_bf16(std::vector<uint16_t>& dst, const WeightRef& w) {
  const size_t n = size_t(numel(w)), base = dst.size();
  dst.resize(base + n);
  if (w.dtype == DType::BF16) {
    std::memcpy(dst.data() + base, w.data, n * 2);
    return;
  }
  std::vector<float> f(n);
  convert_to_f32(w.dtype, w.data, f.data(), n);
  for (size_t i = 0; i < n; ++i) dst[base + i] = f32_to_bf16(f[i]);
}

struct Layer {
  bf16 *attn_norm, *mlp_norm, *wqkv, *bqkv = nullptr, *q_norm = nullptr, *k_norm = nullptr, *wo, *wgu, *wdown;
};

class CudaDenseModel final : public Model {
 public:
  CudaDenseModel(const Checkpoint& ckpt, int device) : cfg_(ckpt.config()), device_(device) {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    gemm_ = std::make_unique<cuda::Gemm>();
    DenseWeights w = bind_dense_weights(ckpt);
    // Plan every upload first (fused q|k|v and gate|up are adjacent parts of one
    // allocation), then copy with a pool of threads straight from the mapped file:
    // bf16 tensors are never copied on the host; others are converted once.
    struct Part {
      bf16* dst;
      const WeightRef* src;
    };
    std::vector<Part> parts;
    int64_t total_bytes = 0;
    auto up = [&](std::initializer_list<const WeightRef*> refs) {
      int64_t n = 0;
      for (auto* p : refs)
        if (p->data) n += numel(*p);
      if (n == 0) return static_cast<bf16*>(nullptr);
      bf16* d = arena_.alloc<bf16>(size_t(n));
      int64_t off = 0;
      for (auto* p : refs)
        if (p->data) {
          parts.push_back({d + off, p});
          off += numel(*p);
        }
      total_bytes += n * 2;
      return d;
    };
    embed_ = up({&w.embed});
    lm_head_ = cfg_.tied_embeddings ? embed_ : up({&w.lm_head});
    final_norm_ = up({&w.final_norm});
    for (auto& l : w.layers) {
      Layer L;
      L.attn_norm = up({&l.attn_norm});
      L.mlp_norm = up({&l.mlp_norm});
      L.wqkv = up({&l.wq, &l.wk, &l.wv});
      if (cfg_.qkv_bias) L.bqkv = up({&l.bq, &l.bk, &l.bv});
      if (cfg_.qk_norm) {
        L.q_norm = up({&l.q_norm});
        L.k_norm = up({&l.k_norm});
      }
      L.wo = up({&l.wo});
      L.wgu = up({&l.w_gate, &l.w_up});
      L.wdown = up({&l.w_down});
      layers_.push_back(L);
    }
    const auto t0 = std::chrono::steady_clock::now();
    std::atomic<size_t> next{0};
    std::exception_ptr err;
    std::mutex err_mu;
    auto worker = [&] {
      try {
        CUDA_CHECK(cudaSetDevice(device_));
        std::vector<uint16_t> host;
        for (size_t i; (i = next++) < parts.size();) {
          const WeightRef& r = *parts[i].src;
          const size_t n = size_t(numel(r));
          if (r.dtype == DType::BF16) {
            CUDA_CHECK(cudaMemcpy(parts[i].dst, r.data, n * 2, cudaMemcpyHostToDevice));
          } else {
            host.clear();
            append_bf16(host, r);
            CUDA_CHECK(cudaMemcpy(parts[i].dst, host.data(), n * 2, cudaMemcpyHostToDevice));
          }
        }
      } catch (...) {
        std::lock_guard lk(err_mu);
        if (!err) err = std::current_exception();
      }
    };
    const int n_threads = int(std::clamp<unsigned>(std::thread::hardware_concurrency(), 1, 8));
    std::vector<std::thread> pool;
    for (int i = 0; i < n_threads; ++i) pool.emplace_back(worker);
    for (auto& t : pool) t.join();
    if (err) std::rethrow_exception(err);
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tlog::info("cuda:{}: uploaded {:.2f} GB of bf16 weights in {:.2f}s ({:.1f} GB/s, {} threads)", device_,
               double(total_bytes) / 1e9, secs, secs > 0 ? double(total_bytes) / 1e9 / secs : 0.0, n_threads);
    auto inv = rope_inv_freq(cfg_.rope, cfg_.head_dim);
    inv_freq_ = arena_.alloc<float>(inv.size());
    CUDA_CHECK(cudaMemcpy(inv_freq_, inv.data(), inv.size() * 4, cudaMemcpyHostToDevice));
    tlog::debug("cuda:{} weights: {:.1f} MiB", device_, double(arena_.bytes()) / (1 << 20));
  }

  ~CudaDenseModel() override {
    acts_.reset();
    gemm_.reset();
    if (stream_) cudaStreamDestroy(stream_);
  }

  const ModelConfig& config() const override { return cfg_; }
  std::string backend() const override { return "cuda:" + std::to_string(device_); }

  void forward(const Batch& b, const Capture& cap, float* logits) override {
    CUDA_CHECK(cudaSetDevice(device_));
    const ModelConfig& c = cfg_;
    const int64_t N = b.n_tokens(), H = c.hidden, I = c.intermediate, hd = c.head_dim, V = c.vocab;
    const int64_t nh = c.n_heads, nkv = c.n_kv_heads, qd = nh * hd, kvd = nkv * hd, ldqkv = qd + 2 * kvd;
    const float eps = float(c.rms_eps);
    cap.validate(c.n_layers);
    for (int64_t i = 0; i < N; ++i)
      TALON_CHECK(b.tokens[size_t(i)] >= 0 && b.tokens[size_t(i)] < V, "token id {} at position {} is outside the vocabulary [0, {})",
                  b.tokens[size_t(i)], i, V);
    ensure_activations(N, b.n_seqs(), logits != nullptr);
    Acts& a = *acts_;

    std::vector<int32_t> pos(static_cast<size_t>(N)), row_seq(static_cast<size_t>(N));
    for (int64_t s = 0; s < b.n_seqs(); ++s)
      for (int64_t r = b.seq_start[size_t(s)]; r < b.seq_start[size_t(s + 1)]; ++r) {
        pos[size_t(r)] = int32_t(r - b.seq_start[size_t(s)]);
        row_seq[size_t(r)] = int32_t(s);
      }
    CUDA_CHECK(cudaMemcpyAsync(a.ids, b.tokens.data(), size_t(N) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(a.pos, pos.data(), size_t(N) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(a.row_seq, row_seq.data(), size_t(N) * 4, cudaMemcpyHostToDevice, stream_));
    CUDA_CHECK(cudaMemcpyAsync(a.seq_start, b.seq_start.data(), b.seq_start.size() * 8, cudaMemcpyHostToDevice, stream_));

    // bf16 captures are converted on the device, so only half the bytes cross PCIe.
    auto capture = [&](int64_t layer_id) {
      for (size_t i = 0; i < cap.layers.size(); ++i) {
        if (cap.layers[i] != layer_id) continue;
        const int64_t ld = cap.stride(i, H);
        if (cap.dtype == DType::F32) {
          CUDA_CHECK(cudaMemcpy2DAsync(cap.out[i], size_t(ld) * 4, a.x, size_t(H) * 4, size_t(H) * 4, size_t(N),
                                       cudaMemcpyDeviceToHost, stream_));
        } else {
          cuda::f32_to_bf16(a.cap16, a.x, N * H, stream_);
          CUDA_CHECK(cudaMemcpy2DAsync(cap.out[i], size_t(ld) * 2, a.cap16, size_t(H) * 2, size_t(H) * 2, size_t(N),
                                       cudaMemcpyDeviceToHost, stream_));
        }
      }
    };
    cuda::embedding_forward(a.x, a.ids, embed_, N, H, V, stream_);
    const bf16* pending = nullptr;  // residual branch output not yet added to x
    for (int64_t l = 0; l < c.n_layers; ++l) {
      const Layer& L = layers_[size_t(l)];
      // x += pending (previous MLP); capture h[l]; xn = norm(x)
      if (pending) {
        cuda::add_rmsnorm_forward(a.xn, a.x, pending, L.attn_norm, N, H, eps, stream_);
        capture(l);
      } else {
        capture(l);
        cuda::add_rmsnorm_forward(a.xn, a.x, nullptr, L.attn_norm, N, H, eps, stream_);
      }
      gemm_->forward(a.qkv, a.xn, L.wqkv, N, H, ldqkv, stream_);
      if (L.bqkv) cuda::bias_forward(a.qkv, ldqkv, L.bqkv, N, ldqkv, stream_);
      if (L.q_norm) {
        cuda::head_rmsnorm_forward(a.qkv, ldqkv, L.q_norm, N, nh, hd, eps, stream_);
        cuda::head_rmsnorm_forward(a.qkv + qd, ldqkv, L.k_norm, N, nkv, hd, eps, stream_);
      }
      cuda::rope_forward(a.qkv, ldqkv, a.pos, inv_freq_, N, nh, hd, stream_);
      cuda::rope_forward(a.qkv + qd, ldqkv, a.pos, inv_freq_, N, nkv, hd, stream_);
      cuda::attention_forward(a.att, a.qkv, ldqkv, a.seq_start, a.row_seq, N, nh, nkv, hd, c.sliding_window, stream_);
      gemm_->forward(a.tmp, a.att, L.wo, N, qd, H, stream_);
      cuda::add_rmsnorm_forward(a.xn, a.x, a.tmp, L.mlp_norm, N, H, eps, stream_);
      gemm_->forward(a.gu, a.xn, L.wgu, N, H, 2 * I, stream_);
      cuda::swiglu_forward(a.act, a.gu, N, I, stream_);
      gemm_->forward(a.tmp, a.act, L.wdown, N, I, H, stream_);
      pending = a.tmp;
    }
    // h[L] = x + last MLP output; the final norm follows (only needed for logits).
    cuda::add_rmsnorm_forward(a.xn, a.x, pending, final_norm_, N, H, eps, stream_);
    capture(c.n_layers);
    if (logits) {
      gemm_->forward(a.logits, a.xn, lm_head_, N, H, V, stream_);
      cuda::bf16_to_f32(a.logits32, a.logits, N * V, stream_);
      CUDA_CHECK(cudaMemcpyAsync(logits, a.logits32, size_t(N * V) * 4, cudaMemcpyDeviceToHost, stream_));
    }
    CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  struct Acts {
    DeviceArena arena;
    int64_t cap_tokens = 0, cap_seqs = 0;
    bool has_logits = false;
    float *x, *logits32 = nullptr, *dummy = nullptr;
    bf16 *xn, *qkv, *att, *tmp, *gu, *act, *cap16, *logits = nullptr;
    int32_t *ids, *pos, *row_seq;
    int64_t* seq_start;
  };

  void ensure_activations(int64_t N, int64_t S, bool want_logits) {
    if (acts_ && acts_->cap_tokens >= N && acts_->cap_seqs >= S && (acts_->has_logits || !want_logits)) return;
    const ModelConfig& c = cfg_;
    const int64_t n = std::max<int64_t>(N, acts_ ? acts_->cap_tokens : 0);
    const int64_t s = std::max<int64_t>(S, acts_ ? acts_->cap_seqs : 0);
    const bool lg = want_logits || (acts_ && acts_->has_logits);
    acts_.reset();
    auto a = std::make_unique<Acts>();
    const int64_t qd = c.n_heads * c.head_dim, ld = qd + 2 * c.n_kv_heads * c.head_dim;
    a->x = a->arena.alloc<float>(size_t(n * c.hidden));
    a->xn = a->arena.alloc<bf16>(size_t(n * c.hidden));
    a->qkv = a->arena.alloc<bf16>(size_t(n * ld));
    a->att = a->arena.alloc<bf16>(size_t(n * qd));
    a->tmp = a->arena.alloc<bf16>(size_t(n * c.hidden));
    a->gu = a->arena.alloc<bf16>(size_t(n * 2 * c.intermediate));
    a->act = a->arena.alloc<bf16>(size_t(n * c.intermediate));
    a->cap16 = a->arena.alloc<bf16>(size_t(n * c.hidden));
    if (lg) {
      a->logits = a->arena.alloc<bf16>(size_t(n * c.vocab));
      a->logits32 = a->arena.alloc<float>(size_t(n * c.vocab));
    }
    a->ids = a->arena.alloc<int32_t>(size_t(n));
    a->pos = a->arena.alloc<int32_t>(size_t(n));
    a->row_seq = a->arena.alloc<int32_t>(size_t(n));
    a->seq_start = a->arena.alloc<int64_t>(size_t(s + 1));
    a->cap_tokens = n;
    a->cap_seqs = s;
    a->has_logits = lg;
    acts_ = std::move(a);
  }

  ModelConfig cfg_;
  int device_;
  cudaStream_t stream_ = nullptr;
  DeviceArena arena_;
  std::unique_ptr<cuda::Gemm> gemm_;
  bf16 *embed_, *lm_head_, *final_norm_;
  float* inv_freq_;
  std::vector<Layer> layers_;
  std::unique_ptr<Acts> acts_;
};

}  // namespace

std::unique_ptr<Model> make_cuda_model(const Checkpoint& ckpt, int device) {
  int n = 0;
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0)
    fail("--device cuda: no CUDA device available ({})", e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
  TALON_CHECK(device >= 0 && device < n, "--device cuda:{}: only {} device(s) present", device, n);
  return std::make_unique<CudaDenseModel>(ckpt, device);
}

}  // namespace talon
