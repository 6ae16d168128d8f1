// Expert upload for the CUDA MoE (moe_weights.h).
#include "backend/cuda/moe_weights.h"

#include <cuda_runtime.h>

#include <cstring>

#include "util/dtype.h"
#include "util/error.h"

namespace talon::cuda {

MoeRouting moe_routing(const ModelConfig& c) {
  const DeepseekConfig& d = c.ds;
  MoeRouting r;
  r.n_experts = int(d.n_routed_experts);
  r.top_k = int(d.num_experts_per_tok);
  r.scoring = d.scoring_func;
  r.method = d.topk_method;
  r.n_group = int(d.n_group);
  r.topk_group = int(d.topk_group);
  r.norm_topk = d.norm_topk_prob;
  r.routed_scale = float(d.routed_scaling_factor);
  return r;
}

namespace {

// All experts' `pick` matrices stacked: int4 and FP8 block-quantized as stored (FP8 block
// scales as fp32), anything else as bf16. `experts` is the uploaded window; `first` the
// layer's id of its first expert (for messages).
ExpertMatrix upload_stack(const std::vector<DeepseekMlp>& experts, int64_t first, QuantWeight DeepseekMlp::*pick,
                          const char* what, DeviceArena& arena, int64_t& bytes) {
  const QuantWeight& q0 = experts[0].*pick;
  const int64_t E = int64_t(experts.size()), O = q0.rows, I = q0.cols;
  ExpertMatrix m;
  m.O = O, m.I = I;
  const bool int4 = q0.kind == QuantWeight::Kind::Int4Group, fp8 = q0.kind == QuantWeight::Kind::Fp8Block;
  auto storage = [](const QuantWeight& q) {
    return q.kind == QuantWeight::Kind::Int4Group  ? fmt::format("int4 group {}", q.group)
           : q.kind == QuantWeight::Kind::Fp8Block ? fmt::format("fp8 block {}x{}", q.block_rows, q.block_cols)
                                                   : std::string("plain");
  };
  for (int64_t e = 0; e < E; ++e) {
    const QuantWeight& q = experts[size_t(e)].*pick;
    TALON_CHECK(q.rows == O && q.cols == I && q.kind == q0.kind && (!int4 || q.group == q0.group) &&
                    (!fp8 || (q.block_rows == q0.block_rows && q.block_cols == q0.block_cols)),
                "expert {} {}: [{}, {}] ({}), expected [{}, {}] ({}) like expert {} (the stacked GPU layout needs one "
                "shape and one storage for all experts)",
                first + e, what, q.rows, q.cols, storage(q), O, I, storage(q0), first);
  }
  if (fp8) {
    // e4m3 bytes as stored, the scale_inv blocks as fp32: the GEMM dequantizes in its tiles.
    const int64_t bo = q0.block_rows, bi = q0.block_cols;
    TALON_CHECK(bo > 0 && bi > 0, "expert {} {}: fp8 block {}x{}", first, what, bo, bi);
    const int64_t nb = ((O + bo - 1) / bo) * ((I + bi - 1) / bi);
    m.bo = bo, m.bi = bi;
    auto* w8 = arena.alloc<uint8_t>(size_t(E * O * I));
    auto* bs = arena.alloc<float>(size_t(E * nb));
    std::vector<float> sc(static_cast<size_t>(nb));
    for (int64_t e = 0; e < E; ++e) {
      const QuantWeight& q = experts[size_t(e)].*pick;
      TALON_CHECK(q.w.dtype == DType::F8_E4M3 && dtype_size(q.w.dtype) == 1, "expert {} {}: fp8 weight stored as {}",
                  first + e, what, dtype_name(q.w.dtype));
      CUDA_CHECK(cudaMemcpy(w8 + e * O * I, q.w.data, size_t(O * I), cudaMemcpyHostToDevice));
      convert_to_f32(q.scale.dtype, q.scale.data, sc.data(), sc.size());
      CUDA_CHECK(cudaMemcpy(bs + e * nb, sc.data(), sc.size() * 4, cudaMemcpyHostToDevice));
    }
    m.fp8 = w8;
    m.block_scale = bs;
    bytes += E * (O * I + nb * 4);
    return m;
  }
  if (int4) {
    const int64_t words = (I + 7) / 8, groups = (I + q0.group - 1) / q0.group;
    m.group = q0.group;
    auto* packed = arena.alloc<int32_t>(size_t(E * O * words));
    auto* scale = arena.alloc<bf16>(size_t(E * O * groups));
    std::vector<uint16_t> sc(size_t(O * groups));
    std::vector<float> row(static_cast<size_t>(groups));
    for (int64_t e = 0; e < E; ++e) {
      const QuantWeight& q = experts[size_t(e)].*pick;
      CUDA_CHECK(cudaMemcpy(packed + e * O * words, q.w.data, size_t(O * words) * 4, cudaMemcpyHostToDevice));
      const size_t es = dtype_size(q.scale.dtype);
      for (int64_t o = 0; o < O; ++o) {
        convert_to_f32(q.scale.dtype, static_cast<const uint8_t*>(q.scale.data) + size_t(o * groups) * es, row.data(),
                       size_t(groups));
        for (int64_t g = 0; g < groups; ++g) sc[size_t(o * groups + g)] = talon::f32_to_bf16(row[size_t(g)]);
      }
      CUDA_CHECK(cudaMemcpy(scale + e * O * groups, sc.data(), sc.size() * 2, cudaMemcpyHostToDevice));
    }
    m.packed = packed;
    m.scale = scale;
    bytes += E * O * (words * 4 + groups * 2);
    return m;
  }
  auto* w = arena.alloc<bf16>(size_t(E * O * I));
  std::vector<float> f(size_t(O * I));
  for (int64_t e = 0; e < E; ++e) {
    dequantize(experts[size_t(e)].*pick, f.data());
    copy_bf16(w + e * O * I, f.data(), f.size());
  }
  m.w = w;
  bytes += E * O * I * 2;
  return m;
}

}  // namespace

MoeLayerDev upload_moe_layer(const DeepseekLayer& L, const ModelConfig& c, DeviceArena& arena, int64_t first,
                             int64_t count) {
  TALON_CHECK(L.moe && !L.experts.empty(), "upload_moe_layer: not a MoE layer");
  MoeLayerDev d;
  d.routing = moe_routing(c);
  TALON_CHECK(int64_t(L.experts.size()) == int64_t(d.routing.n_experts), "MoE layer: {} experts, config says {}",
              L.experts.size(), d.routing.n_experts);
  if (count < 0) count = int64_t(L.experts.size()) - first;
  TALON_CHECK(first >= 0 && count > 0 && first + count <= int64_t(L.experts.size()),
              "MoE layer: experts [{}, {}) outside the layer's {}", first, first + count, L.experts.size());
  const std::vector<DeepseekMlp> mine(L.experts.begin() + first, L.experts.begin() + first + count);
  d.experts.gate = upload_stack(mine, first, &DeepseekMlp::gate, "gate_proj", arena, d.bytes);
  d.experts.up = upload_stack(mine, first, &DeepseekMlp::up, "up_proj", arena, d.bytes);
  d.experts.down = upload_stack(mine, first, &DeepseekMlp::down, "down_proj", arena, d.bytes);
  if (L.router_bias.data) {
    const std::vector<float> b = weight_to_f32(L.router_bias);
    d.router_bias = arena.alloc<float>(b.size());
    CUDA_CHECK(cudaMemcpy(d.router_bias, b.data(), b.size() * 4, cudaMemcpyHostToDevice));
  }
  return d;
}

}  // namespace talon::cuda
