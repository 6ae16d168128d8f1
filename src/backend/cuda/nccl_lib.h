// NCCL, loaded at run time (dlopen of libnccl.so.2): a build made where only the header
// exists still runs on machines without NCCL; only multi-GPU work needs it.
#pragma once
#include <dlfcn.h>

#include "util/error.h"

#if __has_include(<nccl.h>)
#include <nccl.h>
#define TALON_HAVE_NCCL_H 1
#else
#define TALON_HAVE_NCCL_H 0
#endif

namespace talon {

#if TALON_HAVE_NCCL_H
// The few NCCL entry points used, resolved from the shared library.
struct Nccl {
  decltype(&ncclCommInitAll) comm_init_all = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;

  static const Nccl& get() {
    static const Nccl n = [] {
      Nccl x;
      void* h = nullptr;
      for (const char* name : {"libnccl.so.2", "libnccl.so"})
        if ((h = dlopen(name, RTLD_NOW | RTLD_GLOBAL))) break;
      if (!h)
        fail("more than one GPU needs NCCL, but libnccl.so.2 could not be loaded ({}); install NCCL or add its lib "
             "directory to LD_LIBRARY_PATH",
             dlerror());
      auto sym = [&](const char* s) {
        void* p = dlsym(h, s);
        if (!p) fail("libnccl.so.2 has no symbol {} (NCCL too old?)", s);
        return p;
      };
      x.comm_init_all = reinterpret_cast<decltype(x.comm_init_all)>(sym("ncclCommInitAll"));
      x.all_reduce = reinterpret_cast<decltype(x.all_reduce)>(sym("ncclAllReduce"));
      x.comm_destroy = reinterpret_cast<decltype(x.comm_destroy)>(sym("ncclCommDestroy"));
      x.comm_abort = reinterpret_cast<decltype(x.comm_abort)>(sym("ncclCommAbort"));
      x.error_string = reinterpret_cast<decltype(x.error_string)>(sym("ncclGetErrorString"));
      x.group_start = reinterpret_cast<decltype(x.group_start)>(sym("ncclGroupStart"));
      x.group_end = reinterpret_cast<decltype(x.group_end)>(sym("ncclGroupEnd"));
      x.send = reinterpret_cast<decltype(x.send)>(sym("ncclSend"));
      x.recv = reinterpret_cast<decltype(x.recv)>(sym("ncclRecv"));
      x.get_unique_id = reinterpret_cast<decltype(x.get_unique_id)>(sym("ncclGetUniqueId"));
      x.comm_init_rank = reinterpret_cast<decltype(x.comm_init_rank)>(sym("ncclCommInitRank"));
      x.all_gather = reinterpret_cast<decltype(x.all_gather)>(sym("ncclAllGather"));
      x.broadcast = reinterpret_cast<decltype(x.broadcast)>(sym("ncclBroadcast"));
      return x;
    }();
    return n;
  }
  void check(ncclResult_t r, const char* what) const {
    if (r != ncclSuccess) fail("NCCL {} failed: {}", what, error_string(r));
  }
};
#endif

}  // namespace talon
