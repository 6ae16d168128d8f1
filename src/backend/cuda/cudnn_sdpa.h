// Internal to the CUDA backend: causal attention over packed samples through cuDNN's fused
// scaled-dot-product attention (the cuDNN frontend's graph API), forward and backward.
//
// Samples are packed rows, as everywhere in Talon: sample b owns rows seq_start[b] ..
// seq_start[b+1]. Row-major bf16 operands, by default packed heads: Q, O, dO, dQ [N, nh*hd];
// K, V, dK, dV [N, nkv*hd] (grouped-query attention when nkv < nh: head h reads kv head
// h / (nh / nkv)); SdpaShape describes strided layouts (a fused qkv buffer, MLA's value heads
// of another size). dO and dQ have O's and Q's layouts, dK and dV K's and V's. The log-sum-exp
// is fp32 [N, nh], natural log of the scaled scores, the same layout and convention as
// ttt_attention.h. Row i of a sample attends keys 0..i of that sample.
//
// The backward takes O and lse as given: with the output and statistics of a softmax over MORE
// keys than the causal ones (the draft trainer's diagonal keys), it returns the exact gradients
// of the causal part (P = exp(scale Q K^T - lse), D = rowsum(dO * O)).
//
// cuDNN is not linked: libcudnn.so.9 is loaded on first use (cudnn_sdpa_available() says
// whether it could be, and why not). Plans are built once per bucket of (samples, longest
// sample): both rounded up to powers of two, extra samples empty.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace talon::cuda {

// Whether this build has the cuDNN route (the frontend's headers were found at configure time).
bool cudnn_sdpa_built();
// Whether this build has the cuDNN route and libcudnn could be loaded; why not in *why.
bool cudnn_sdpa_available(std::string* why = nullptr);
// The loaded cuDNN's version (e.g. 91500), 0 when none is loaded.
int64_t cudnn_version();

struct SdpaShape {
  int nh = 0, nkv = 0, hd = 0;  // hd: the query/key head size
  float scale = 0.f;
  int64_t max_rows = 0;  // the most rows any batch will have (sizes the plans' packed totals)
  // Layouts other than packed heads (0: the default). hd_v: the value/output head size (hd);
  // ld_*: row strides of Q, K, V, O in elements (heads x head size); hs_v: V's head stride
  // (hd_v). A fused qkv buffer is Q, K, V at their columns with ld_q = ld_k = ld_v its width.
  int hd_v = 0;
  int64_t ld_q = 0, ld_k = 0, ld_v = 0, ld_o = 0, hs_v = 0;
  // Also the backward's plans and the forward's log-sum-exp (training); false: forward only,
  // forward(..., lse = nullptr).
  bool backward = true;
};

// Which attention the target forward's prefill (extract, the online trainer's target) takes, from
// TALON_ATTENTION (read once):
//   cudnn  cuDNN's fused attention where it can serve the model (cudnn_sdpa_unsupported; sliding
//          windows are not), else the tensor-core kernels of attention.cu (the first forward logs
//          why at info level); a failure inside cuDNN is an error;
//   auto   the same, and a failure inside cuDNN (a plan it cannot build) logs a warning and hands
//          the rest of the run to the kernels;
//   anything else (unset, flash, warp): the kernels.
enum class PrefillAttention { Kernels, Cudnn, Auto };
PrefillAttention prefill_attention();
inline bool prefill_attention_cudnn() { return prefill_attention() != PrefillAttention::Kernels; }
class CudnnSdpa;
// The prefill's CudnnSdpa for `shape` (rows: shape.max_rows), made when the route is chosen, the
// model is served (`refused`: a reason of the caller's, e.g. a sliding window; else
// cudnn_sdpa_unsupported) and `sdpa` holds fewer rows; where it is not served, `off` is set and the
// reason logged once. Under `auto` a failure to make it is logged and sets `off` too.
void prefill_make(std::unique_ptr<CudnnSdpa>& sdpa, bool& off, const SdpaShape& shape, const std::string& refused,
                  cudaStream_t s, int device);
// The prefill's CudnnSdpa::set_batch (nothing when `sdpa` is empty): under `auto` a failure logs a
// warning, drops `sdpa` and sets `off` (the kernels serve the rest of the run); under `cudnn` it
// throws.
void prefill_set_batch(std::unique_ptr<CudnnSdpa>& sdpa, bool& off, const std::vector<int64_t>& seq_start,
                       const int64_t* seq_start_d, int device);

// "" when CudnnSdpa can be made for `shape` (cuDNN loads; heads a multiple of kv heads, head sizes
// multiples of 8 up to 256, 32-bit offsets suffice), else why not.
std::string cudnn_sdpa_unsupported(const SdpaShape& shape);
// The cuDNN frontend's own checks of the forward and backward graphs for a batch of n_samples
// samples of up to `longest` rows (no plans are built), the backward also over backward_groups
// head groups (CudnnSdpa::set_backward_limit); "" when they pass, else the message.
std::string cudnn_sdpa_validate(const SdpaShape& shape, int64_t n_samples, int64_t longest, int backward_groups = 1);

class CudnnSdpa {
 public:
  struct Impl;
  // Binds to the current device and stream s; throws talon::Error (naming what is missing) when
  // cuDNN cannot serve the shape.
  CudnnSdpa(const SdpaShape& shape, cudaStream_t s);
  ~CudnnSdpa();
  CudnnSdpa(const CudnnSdpa&) = delete;
  CudnnSdpa& operator=(const CudnnSdpa&) = delete;

  // The batch's samples: seq_start (B + 1 values, host) and the same values on the device.
  // Builds (or reuses) the plans of its bucket and writes the offsets cuDNN reads, on the stream.
  void set_batch(const std::vector<int64_t>& seq_start, const int64_t* seq_start_d);
  // o, lse[N, nh] = causal attention of q over k, v (lse only with backward).
  void forward(__nv_bfloat16* o, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
               const __nv_bfloat16* v);
  // dq, dk, dv (overwritten) given o, dO and lse (see above).
  void backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* q,
                const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* o, const __nv_bfloat16* dO,
                const float* lse);
  // The workspace the plans for a batch of n_samples samples of up to `longest` rows need (the
  // larger of the forward's and the backward's; the plans are built now if they were not).
  int64_t workspace_bytes(int64_t n_samples, int64_t longest);
  // Lends it `bytes` of device memory at p for its workspace (nullptr or 0: none), which the
  // caller keeps idle whenever forward() or backward() runs, on the stream. Batches whose
  // plans need more take a workspace of its own, as without one lent. Call set_batch after.
  void set_workspace(void* p, int64_t bytes);
  // The backward in head groups: for each bucket, the fewest groups (a power of two dividing
  // the kv heads, so each group's query heads are whole GQA groups and each kv head's dK, dV
  // come from one execution; four query heads or more a group) whose workspace is at most
  // `bytes`, where some are; one
  // execution a group, each over its heads' strided views. cuDNN's deterministic backward
  // takes samples x heads x S^2 x 2 bytes, so G groups take a G-th. 0 (the default): one
  // backward over every head. Drops the plans built so far; call set_batch after.
  void set_backward_limit(int64_t bytes);
  // The backward's head groups for a batch of n_samples samples of up to `longest` rows
  // (building its plans if they were not).
  int backward_groups(int64_t n_samples, int64_t longest);
  // Device bytes held (its own workspace and offsets; not a lent workspace).
  int64_t bytes() const;
  // The most rows a batch may have (SdpaShape::max_rows).
  int64_t rows() const;

 private:
  std::unique_ptr<Impl> p_;
};

// The offsets of a ragged batch of n_b samples (bucketed to nb_pad >= n_b), written on the
// device from seq_start_d: off[b] = seq_start[min(b, n_b)] * per_row for b <= nb_pad and, when
// len is given, len[b] = the rows of sample b (0 past n_b). Internal to cudnn_sdpa.cpp.
void sdpa_ragged_offsets(int32_t* off, int32_t* len, const int64_t* seq_start_d, int n_b, int nb_pad,
                         int64_t per_row, cudaStream_t s);

}  // namespace talon::cuda
