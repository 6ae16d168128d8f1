#include "backend/cuda/device.h"

#include "backend/cuda/check.h"
#include "util/error.h"

namespace talon::cuda {

Device::Device(int device, const std::string& who, bool copy_stream) : device_(device) {
  int n = 0;
  if (const cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess || n == 0) {
    cudaGetLastError();  // clear the sticky "no driver" state
    fail("{}: cuda:{} was asked for, but no CUDA device is usable on this machine ({}); use --device cpu", who, device,
         e != cudaSuccess ? cudaGetErrorString(e) : "0 devices visible");
  }
  TALON_CHECK(device >= 0 && device < n, "{}: cuda:{} does not exist ({} device{} visible)", who, device, n,
              n == 1 ? "" : "s");
  try {
    activate();
    CUDA_CHECK(cudaDeviceGetAttribute(&n_sms_, cudaDevAttrMultiProcessorCount, device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (copy_stream) CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
  } catch (...) {
    release();
    throw;
  }
}

Device::~Device() { release(); }

void Device::release() noexcept {
  cudaSetDevice(device_);
  if (stream_) cudaStreamSynchronize(stream_);
  if (copy_) cudaStreamSynchronize(copy_);
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  events_.clear();
  gemm_.reset();
  if (blas_) cublasDestroy(blas_);
  blas_ = nullptr;
  if (copy_) cudaStreamDestroy(copy_);
  if (stream_) cudaStreamDestroy(stream_);
  copy_ = stream_ = nullptr;
}

void Device::activate() const { CUDA_CHECK(cudaSetDevice(device_)); }

void Device::sync() const {
  activate();
  CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (copy_) CUDA_CHECK(cudaStreamSynchronize(copy_));
}

Gemm& Device::gemm() {
  if (!gemm_) {
    activate();
    gemm_ = std::make_unique<Gemm>();
  }
  return *gemm_;
}

cublasHandle_t Device::blas() {
  if (!blas_) {
    activate();
    cublasHandle_t h = nullptr;
    CUBLAS_CHECK(cublasCreate(&h));
    blas_ = h;
    CUBLAS_CHECK(cublasSetStream(blas_, stream_));
  }
  return blas_;
}

cudaEvent_t Device::event(size_t i) {
  while (events_.size() <= i) {
    activate();
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    events_.push_back(e);
  }
  return events_[i];
}

std::pair<size_t, size_t> Device::memory() const {
  activate();
  size_t free_b = 0, total_b = 0;
  CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  return {free_b, total_b};
}

}  // namespace talon::cuda
