// A trace of what runs on the GPUs and what the host asks of CUDA, through CUPTI's activity API
// (kernels, copies, fills, CUDA runtime calls, synchronizations), for backend/trace_gaps.h.
// libcupti is opened at run time (TALON_CUPTI_LIB names it, else libcupti.so.13 / libcupti.so
// from the loader's path), so nothing else depends on it.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/trace_gaps.h"

namespace talon::cuda {

class CuptiTrace {
 public:
  // Whether CUPTI could be loaded; why not in *why.
  static bool available(std::string* why = nullptr);
  // Starts recording (throws talon::Error naming what failed). One trace at a time per process.
  CuptiTrace();
  ~CuptiTrace();
  CuptiTrace(const CuptiTrace&) = delete;
  CuptiTrace& operator=(const CuptiTrace&) = delete;
  // CUPTI's clock now (ns; the events' timebase), 0 where CUPTI is not available.
  static uint64_t now();
  // Stops recording (the device work is flushed first: call after synchronizing) and returns
  // the events, timestamps in ns on CUPTI's clock.
  std::vector<TraceEvent> stop();

 private:
  bool running_ = false;
};

}  // namespace talon::cuda
