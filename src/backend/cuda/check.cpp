#include "backend/cuda/check.h"

#include "backend/backend.h"
#include "util/error.h"

namespace talon::cuda {

void fail_cuda(const char* lib, int code, const char* what, const char* expr, const char* file, int line) {
  fail("{} error {} ({}) in {} at {}:{}", lib, code, what, expr, file, line);
}

void fail_msg(const std::string& msg) { throw Error(msg); }

}  // namespace talon::cuda
namespace talon { bool cuda_backend_built() { return true; } }
