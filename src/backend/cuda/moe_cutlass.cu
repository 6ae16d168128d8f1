// The MoE experts' bf16 grouped GEMM through CUTLASS (see moe_cutlass.h).
#include "backend/cuda/moe_cutlass.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

#include "backend/cuda/check.h"

#ifdef TALON_HAVE_CUTLASS
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#endif

namespace talon::cuda {

namespace {
std::atomic<int> g_use{-1};
}

void moe_cutlass_use(int mode) { g_use = mode; }

namespace {
std::atomic<int> g_tiles{-1};
}

void moe_cutlass_tiles(int config) { g_tiles = config >= 0 && config <= 2 ? config : -1; }

int moe_cutlass_tiles() {
  static const int env = [] {
    const char* e = std::getenv("TALON_MOE_CUTLASS_TILES");
    if (!e || !*e || std::strcmp(e, "rows128") == 0) return 0;
    if (std::strcmp(e, "out128x64") == 0) return 1;
    if (std::strcmp(e, "out128x128") == 0) return 2;
    fail_msg(std::string("TALON_MOE_CUTLASS_TILES=") + e + ": expected rows128, out128x64 or out128x128");
  }();
  const int t = g_tiles.load();
  return t < 0 ? env : t;
}

bool moe_cutlass_requested() {
  static const bool env = [] {
    const char* e = std::getenv("TALON_MOE_GEMM");
    if (!e || !*e) return moe_cutlass_built();
    if (std::strcmp(e, "cutlass") == 0) return true;
    if (std::strcmp(e, "tiles") == 0) return false;
    fail_msg(std::string("TALON_MOE_GEMM=") + e + ": expected cutlass or tiles");
  }();
  const int m = g_use.load();
  return m < 0 ? env : m > 0;
}

bool moe_cutlass_fits(const void* a, const void* w, const void* out, int64_t N, int64_t K) {
  const auto al = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return K > 0 && N > 0 && K % 8 == 0 && N % 4 == 0 && al(a) && al(w) && al(out) && N < (int64_t(1) << 31) &&
         K < (int64_t(1) << 31);
}

__nv_bfloat16* moe_cutlass_rows(int64_t n, cudaStream_t s) {
  struct Rows {
    __nv_bfloat16* p = nullptr;
    int64_t cap = 0;
  };
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, Rows> rows;  // per device and stream
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  Rows* r;
  {
    std::lock_guard lk(mu);
    r = &rows[{dev, s}];
  }
  if (n > r->cap) {  // one thread owns a device (and its streams), so only it touches its entry
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (r->p) CUDA_CHECK(cudaFree(r->p));
    r->p = nullptr;
    CUDA_CHECK(cudaMalloc(&r->p, size_t(n) * 2));
    r->cap = n;
  }
  return r->p;
}

#ifdef TALON_HAVE_CUTLASS

namespace {

using namespace cute;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per expert
using Shape3 = typename ProblemShape::UnderlyingProblemShape;
constexpr int kAlign16 = 8, kAlignD = 4;  // 16 bytes of bf16 / of fp32

// One grouped-GEMM configuration. SWAP false: M = the expert's routed rows (A, row-major, K
// contiguous), N = its outputs (B = w[e]^T, K contiguous), D row-major [rows, N]; tiles of 128
// rows x 128 outputs (an expert of 170 rows takes two row tiles, a third of them empty).
// SWAP true: the product transposed, M = the outputs (A = w[e], row-major), N = the routed rows
// (B = their rows, K contiguous), D column-major [N outputs, rows], which is the same memory as
// the row-major [rows, N outputs] out: tiles of 128 outputs x TN rows, so an expert's rows are
// padded to a multiple of TN (64: 170 rows take 192) instead of 128, and the two M tiles of a
// cluster share each row tile (TMA multicast).
template <bool SWAP, int TN>
struct GroupedGemm {
  static constexpr bool kSwap = SWAP;
  using ElementA = cutlass::bfloat16_t;
  using ElementB = cutlass::bfloat16_t;
  using ElementC = float;  // C = D: beta is 0, so the epilogue never reads it
  using ElementD = float;
  using LayoutA = cutlass::layout::RowMajor;
  using LayoutB = cutlass::layout::ColumnMajor;
  using LayoutD = std::conditional_t<SWAP, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  using TileShape = Shape<_128, Int<TN>, _64>;
  using ClusterShape = std::conditional_t<SWAP, Shape<_2, _1, _1>, Shape<_1, _2, _1>>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, EpilogueSchedule, cutlass::epilogue::fusion::LinearCombination<ElementD, float>>::CollectiveOp;
  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlign16, ElementB, LayoutB*, kAlign16,
      float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;
  using StrideA = typename Gemm::GemmKernel::InternalStrideA;
  using StrideB = typename Gemm::GemmKernel::InternalStrideB;
  using StrideC = typename Gemm::GemmKernel::InternalStrideC;
  using StrideD = typename Gemm::GemmKernel::InternalStrideD;

  // The per-expert arrays CUTLASS reads, in one device allocation.
  struct Arrays {
    Shape3* shapes;
    const ElementA** a;
    const ElementB** b;
    const ElementC** c;
    ElementD** d;
    StrideA* sa;
    StrideB* sb;
    StrideC* sc;
    StrideD* sd;
  };

  template <class T>
  static size_t aligned_bytes(int E) {
    return (sizeof(T) * size_t(E) + 255) / 256 * 256;
  }

  static size_t arrays_bytes(int E) {
    return aligned_bytes<Shape3>(E) + 4 * aligned_bytes<void*>(E) + aligned_bytes<StrideA>(E) +
           aligned_bytes<StrideB>(E) + aligned_bytes<StrideC>(E) + aligned_bytes<StrideD>(E);
  }

  static Arrays carve(void* base, int E) {
    auto* p = static_cast<uint8_t*>(base);
    Arrays r;
    const auto take = [&](auto*& out, size_t bytes) {
      out = reinterpret_cast<std::remove_reference_t<decltype(out)>>(p);
      p += bytes;
    };
    take(r.shapes, aligned_bytes<Shape3>(E));
    take(r.a, aligned_bytes<void*>(E));
    take(r.b, aligned_bytes<void*>(E));
    take(r.c, aligned_bytes<void*>(E));
    take(r.d, aligned_bytes<void*>(E));
    take(r.sa, aligned_bytes<StrideA>(E));
    take(r.sb, aligned_bytes<StrideB>(E));
    take(r.sc, aligned_bytes<StrideC>(E));
    take(r.sd, aligned_bytes<StrideD>(E));
    return r;
  }
};

// Expert e's problem (rows offsets[e]..offsets[e+1]) and pointers, from the device offsets.
template <class G>
__global__ void setup_kernel(typename G::Arrays r, const int32_t* offsets, const cutlass::bfloat16_t* a,
                             const cutlass::bfloat16_t* w, float* out, int E, int N, int K) {
  const int e = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= E) return;
  const int m = offsets[e + 1] - offsets[e];
  const cutlass::bfloat16_t* rows = a + int64_t(offsets[e]) * K;
  const cutlass::bfloat16_t* we = w + int64_t(e) * N * K;
  float* d = out + int64_t(offsets[e]) * N;
  // Transposed: (M, N, K) = (outputs, rows, K), D column-major with leading dimension M = N.
  const int Mp = G::kSwap ? N : m, Np = G::kSwap ? m : N;
  r.shapes[e] = Shape3(Mp, Np, K);
  r.a[e] = G::kSwap ? we : rows;
  r.b[e] = G::kSwap ? rows : we;
  r.sa[e] = cutlass::make_cute_packed_stride(typename G::StrideA{}, cute::make_shape(Mp, K, 1));
  r.sb[e] = cutlass::make_cute_packed_stride(typename G::StrideB{}, cute::make_shape(Np, K, 1));
  r.sc[e] = cutlass::make_cute_packed_stride(typename G::StrideC{}, cute::make_shape(Mp, Np, 1));
  r.sd[e] = cutlass::make_cute_packed_stride(typename G::StrideD{}, cute::make_shape(Mp, Np, 1));
  r.c[e] = d;
  r.d[e] = d;
}

// Per device and stream: the arrays (sized for the largest configuration) and CUTLASS's workspace,
// grown as needed.
struct DeviceBufs {
  void* arrays = nullptr;
  size_t arrays_bytes = 0;
  void* ws = nullptr;
  size_t ws_bytes = 0;
  int sms = 0;
};
std::mutex g_mu;
std::map<std::pair<int, cudaStream_t>, DeviceBufs> g_bufs;  // per device and stream

void check_cutlass(cutlass::Status st, const char* what) {
  if (st != cutlass::Status::kSuccess)
    fail_msg(std::string("moe (CUTLASS grouped GEMM): ") + what + " failed: " + cutlassGetStatusString(st));
}

template <class G>
void run_grouped(DeviceBufs* B, int dev, float* out, const __nv_bfloat16* a, const __nv_bfloat16* w,
                 const int32_t* offsets, int E, int64_t N, int64_t K, cudaStream_t s) {
  // One thread owns a device and its streams (Talon's rule), so its entries are only touched by
  // that thread; per stream, so that two streams (expert-parallel overlap) never share them.
  const size_t bytes = G::arrays_bytes(E);
  if (B->arrays_bytes < bytes) {
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (B->arrays) CUDA_CHECK(cudaFree(B->arrays));
    B->arrays = nullptr;
    CUDA_CHECK(cudaMalloc(&B->arrays, bytes));
    B->arrays_bytes = bytes;
  }
  if (B->sms == 0) B->sms = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(dev);
  const typename G::Arrays r = G::carve(B->arrays, E);
  setup_kernel<G><<<(E + 127) / 128, 128, 0, s>>>(r, offsets, reinterpret_cast<const cutlass::bfloat16_t*>(a),
                                                  reinterpret_cast<const cutlass::bfloat16_t*>(w), out, E, int(N),
                                                  int(K));
  CUDA_LAUNCH_CHECK();

  cutlass::KernelHardwareInfo hw;
  hw.device_id = dev;
  hw.sm_count = B->sms;
  using Gemm = typename G::Gemm;
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {E, r.shapes, nullptr},
                                {r.a, r.sa, r.b, r.sb},
                                {{}, r.c, r.sc, r.d, r.sd},
                                hw};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  args.epilogue.thread.alpha_ptr = nullptr;
  args.epilogue.thread.beta_ptr = nullptr;
  Gemm gemm;
  check_cutlass(gemm.can_implement(args), "can_implement");
  const size_t need = Gemm::get_workspace_size(args);
  if (need > B->ws_bytes) {
    CUDA_CHECK(cudaStreamSynchronize(s));
    if (B->ws) CUDA_CHECK(cudaFree(B->ws));
    B->ws = nullptr;
    CUDA_CHECK(cudaMalloc(&B->ws, need));
    B->ws_bytes = need;
  }
  check_cutlass(gemm.initialize(args, B->ws, s), "initialize");
  check_cutlass(gemm.run(s), "run");
  CUDA_LAUNCH_CHECK();
}

// cute's GMMA descriptor of a K-major bf16 operand of one k16 step in 8x8 core matrices: rows
// (8 a core matrix, 8 groups sbo_elems apart) x k (8 a core matrix, the two halves 64 elements =
// 128 bytes apart). On the host cute has no shared-window address to give, so the start address
// field is 0 (and cute says so on stdout).
template <int SBO_ELEMS>
uint64_t cute_k_major_desc() {
  auto layout = make_layout(make_shape(make_shape(_8{}, _8{}), make_shape(_8{}, _2{})),
                            make_stride(make_stride(_8{}, Int<SBO_ELEMS>{}), make_stride(_1{}, _64{})));
  const auto t = make_tensor(make_smem_ptr(static_cast<const cutlass::bfloat16_t*>(nullptr)), layout);
  return uint64_t(SM90::GMMA::make_gmma_desc<SM90::GMMA::Major::K>(t));
}

}  // namespace

bool moe_cutlass_built() { return true; }

std::pair<int, int> moe_cutlass_gmma_a_coord(int tid, int v) {
  const int idx = int(SM90::GMMA::ALayout_64x16{}(tid, v));  // column-major over the 64 x 16 tile
  return {idx % 64, idx / 64};
}

std::pair<int, int> moe_cutlass_gmma_d_coord(int tid, int i) {
  const int idx = int(SM90::GMMA::CLayout_64x64{}(tid, i));  // column-major over the 64 x 64 tile
  return {idx % 64, idx / 64};
}

uint64_t moe_cutlass_k_major_desc(int sbo_bytes) {
  switch (sbo_bytes) {
    case 1024: return cute_k_major_desc<512>();
    case 2048: return cute_k_major_desc<1024>();
    default: fail_msg("moe_cutlass_k_major_desc: sbo " + std::to_string(sbo_bytes) + " is not 1024 or 2048");
  }
}

void moe_cutlass_grouped_gemm(float* out, const __nv_bfloat16* a, const __nv_bfloat16* w, const int32_t* offsets,
                              int E, int64_t N, int64_t K, cudaStream_t s) {
  if (E <= 0) return;
  if (!moe_cutlass_fits(a, w, out, N, K))
    fail_msg("moe (CUTLASS grouped GEMM): needs K % 8 == 0, N % 4 == 0 and 16-byte aligned operands (N " +
             std::to_string(N) + ", K " + std::to_string(K) + ")");
  int dev = 0;
  CUDA_CHECK(cudaGetDevice(&dev));
  DeviceBufs* B;
  {
    std::lock_guard lk(g_mu);
    B = &g_bufs[{dev, s}];
  }
  switch (moe_cutlass_tiles()) {
    case 1: run_grouped<GroupedGemm<true, 64>>(B, dev, out, a, w, offsets, E, N, K, s); break;
    case 2: run_grouped<GroupedGemm<true, 128>>(B, dev, out, a, w, offsets, E, N, K, s); break;
    default: run_grouped<GroupedGemm<false, 128>>(B, dev, out, a, w, offsets, E, N, K, s); break;
  }
}

#else  // built without CUTLASS's headers

bool moe_cutlass_built() { return false; }
uint64_t moe_cutlass_k_major_desc(int) { fail_msg("moe_cutlass_k_major_desc: this build has no CUTLASS headers"); }
std::pair<int, int> moe_cutlass_gmma_a_coord(int, int) { fail_msg("moe_cutlass_gmma_a_coord: no CUTLASS headers"); }
std::pair<int, int> moe_cutlass_gmma_d_coord(int, int) { fail_msg("moe_cutlass_gmma_d_coord: no CUTLASS headers"); }
void moe_cutlass_grouped_gemm(float*, const __nv_bfloat16*, const __nv_bfloat16*, const int32_t*, int, int64_t,
                              int64_t, cudaStream_t) {
  fail_msg("TALON_MOE_GEMM=cutlass: this build has no CUTLASS headers (scripts/fetch_cutlass.sh, then reconfigure)");
}

#endif

}  // namespace talon::cuda
