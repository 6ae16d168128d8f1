// One GPU as every CUDA class of the project holds it: the device checked and made current,
// a compute stream (and, when asked for, a copy stream), the cuBLASLt Gemm and the cuBLAS
// handle (made on first use, bound to the compute stream), events made on demand, and a
// DeviceArena for what lives as long as the owner. The destructor waits for both streams and
// releases everything in order; a constructor that throws leaves nothing behind.
//
// Owners declare it as their first member, so it is destroyed last: buffers in the owner's
// other arenas are freed first (cudaFree waits for the device), then the streams and handles.
#pragma once
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/check.h"
#include "backend/cuda/ops.h"

namespace talon::cuda {

// Owns device allocations; freed in reverse on destruction.
class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
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

// A page-locked host buffer that grows on demand: the staging of a forward's packed inputs
// (copied up in one cudaMemcpyAsync) or of results coming down. Growing frees the old block,
// so a caller whose earlier copy from it may still be in flight waits for its stream first.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (p_) cudaFreeHost(p_);
  }
  // At least `bytes` (kept when already that large).
  uint8_t* ensure(size_t bytes) {
    if (bytes > bytes_ || !p_) {
      if (p_) CUDA_CHECK(cudaFreeHost(p_));
      p_ = nullptr;
      CUDA_CHECK(cudaHostAlloc(&p_, std::max<size_t>(bytes, 1), cudaHostAllocPortable));
      bytes_ = std::max<size_t>(bytes, 1);
    }
    return static_cast<uint8_t*>(p_);
  }
  uint8_t* data() const { return static_cast<uint8_t*>(p_); }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

// Byte offsets of the parts of one packed block of inputs, each 16-byte aligned (so a part
// holding int4 / uint4 data can be read with vector loads). Fixed by a forward's shape, so a
// CUDA graph captured for that shape reads the next forward's inputs at the same places.
class PackedOffsets {
 public:
  explicit PackedOffsets(size_t base = 0) : off_(base) {}
  size_t place(size_t bytes) {
    const size_t at = off_;
    off_ += (bytes + 15) / 16 * 16;
    return at;
  }
  size_t bytes() const { return off_; }

 private:
  size_t off_ = 0;
};

class Device {
 public:
  // `who` names the owner in the error when cuda:`device` does not exist.
  Device(int device, const std::string& who, bool copy_stream = false);
  ~Device();
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  int index() const { return device_; }
  std::string name() const { return "cuda:" + std::to_string(device_); }
  // Makes this GPU current for the calling thread (each public entry point of an owner).
  void activate() const;
  cudaStream_t stream() const { return stream_; }
  cudaStream_t copy_stream() const { return copy_; }  // null unless asked for
  void sync() const;                                  // both streams
  Gemm& gemm();
  cublasHandle_t blas();
  // The i-th event (timing disabled), made on first use.
  cudaEvent_t event(size_t i);
  DeviceArena& arena() { return arena_; }
  int multiprocessors() const { return n_sms_; }
  // Free and total bytes of the device now.
  std::pair<size_t, size_t> memory() const;

 private:
  int device_;
  int n_sms_ = 0;
  DeviceArena arena_;  // declared first among the resources: freed after the handles below
  cudaStream_t stream_ = nullptr, copy_ = nullptr;
  std::unique_ptr<Gemm> gemm_;
  cublasHandle_t blas_ = nullptr;
  std::vector<cudaEvent_t> events_;
  void release() noexcept;
};

}  // namespace talon::cuda
