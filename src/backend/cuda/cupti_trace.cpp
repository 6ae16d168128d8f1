// CUPTI activity tracing, libcupti opened at run time (see cupti_trace.h).
#include "backend/cuda/cupti_trace.h"

#include <fmt/format.h>

#include <cstdlib>
#include <cstring>
#include <mutex>

#include "backend/cuda/check.h"

#ifdef TALON_HAVE_CUPTI
#include <cupti.h>
#include <dlfcn.h>
#endif

namespace talon::cuda {

#ifdef TALON_HAVE_CUPTI
namespace {

// The CUPTI functions used, looked up once.
struct Api {
  bool ok = false;
  std::string why;
  decltype(&cuptiActivityRegisterCallbacks) register_callbacks = nullptr;
  decltype(&cuptiActivityEnable) enable = nullptr;
  decltype(&cuptiActivityDisable) disable = nullptr;
  decltype(&cuptiActivityFlushAll) flush_all = nullptr;
  decltype(&cuptiActivityGetNextRecord) next_record = nullptr;
  decltype(&cuptiGetCallbackName) callback_name = nullptr;
  decltype(&cuptiGetResultString) result_string = nullptr;
  decltype(&cuptiGetTimestamp) timestamp = nullptr;
};

const Api& api() {
  static Api a;
  static std::once_flag once;
  std::call_once(once, [] {
    const char* env = std::getenv("TALON_CUPTI_LIB");
    void* h = nullptr;
    std::string tried;
    for (const char* name : {env && *env ? env : "libcupti.so.13", "libcupti.so"}) {
      h = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      tried += (tried.empty() ? "" : ", ") + std::string(name);
      if (h) break;
    }
    if (!h) {
      a.why = "could not load CUPTI (tried " + tried + "); put its directory on LD_LIBRARY_PATH or name it in "
              "TALON_CUPTI_LIB";
      return;
    }
    const auto sym = [&](auto& f, const char* name) {
      f = reinterpret_cast<std::remove_reference_t<decltype(f)>>(dlsym(h, name));
      if (!f && a.why.empty()) a.why = std::string("CUPTI has no ") + name;
    };
    sym(a.register_callbacks, "cuptiActivityRegisterCallbacks");
    sym(a.enable, "cuptiActivityEnable");
    sym(a.disable, "cuptiActivityDisable");
    sym(a.flush_all, "cuptiActivityFlushAll");
    sym(a.next_record, "cuptiActivityGetNextRecord");
    sym(a.callback_name, "cuptiGetCallbackName");
    sym(a.result_string, "cuptiGetResultString");
    sym(a.timestamp, "cuptiGetTimestamp");
    a.ok = a.why.empty();
  });
  return a;
}

void check(CUptiResult r, const char* what) {
  if (r == CUPTI_SUCCESS) return;
  const char* s = nullptr;
  if (api().result_string) api().result_string(r, &s);
  fail_msg(fmt::format("CUPTI: {} failed: {} ({})", what, s ? s : "unknown error", int(r)));
}

// Records are parsed as the buffers complete (CUPTI's threads), into one list.
std::mutex g_mu;
std::vector<TraceEvent>* g_events = nullptr;
constexpr size_t kBufBytes = 8 << 20;

void CUPTIAPI buffer_requested(uint8_t** buf, size_t* size, size_t* max_records) {
  *buf = static_cast<uint8_t*>(std::aligned_alloc(8, kBufBytes));
  *size = *buf ? kBufBytes : 0;
  *max_records = 0;
}

std::string memcpy_name(uint8_t kind) {
  switch (kind) {
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOD: return "memcpy HtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOH: return "memcpy DtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_DTOD: return "memcpy DtoD";
    case CUPTI_ACTIVITY_MEMCPY_KIND_HTOH: return "memcpy HtoH";
    case CUPTI_ACTIVITY_MEMCPY_KIND_PTOP: return "memcpy PtoP";
    default: return "memcpy";
  }
}

std::string sync_name(CUpti_ActivitySynchronizationType t) {
  switch (t) {
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_EVENT_SYNCHRONIZE: return "sync: cudaEventSynchronize";
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_WAIT_EVENT: return "sync: cudaStreamWaitEvent";
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_SYNCHRONIZE: return "sync: cudaStreamSynchronize";
    case CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_CONTEXT_SYNCHRONIZE: return "sync: cudaDeviceSynchronize";
    default: return "sync";
  }
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buf, size_t, size_t valid) {
  std::vector<TraceEvent> got;
  CUpti_Activity* rec = nullptr;
  while (valid > 0 && api().next_record(buf, valid, &rec) == CUPTI_SUCCESS) {
    TraceEvent e;
    switch (rec->kind) {
      case CUPTI_ACTIVITY_KIND_KERNEL:
      case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const auto* k = reinterpret_cast<const CUpti_ActivityKernel10*>(rec);
        e = {TraceEvent::Kind::Kernel, k->name ? k->name : "kernel", k->start, k->end, k->streamId, 0};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemcpy6*>(rec);
        e = {TraceEvent::Kind::Memcpy, memcpy_name(m->copyKind), m->start, m->end, m->streamId, m->bytes};
        break;
      }
      case CUPTI_ACTIVITY_KIND_MEMSET: {
        const auto* m = reinterpret_cast<const CUpti_ActivityMemset4*>(rec);
        e = {TraceEvent::Kind::Memset, "memset", m->start, m->end, m->streamId, m->bytes};
        break;
      }
      case CUPTI_ACTIVITY_KIND_RUNTIME: {
        const auto* a = reinterpret_cast<const CUpti_ActivityAPI*>(rec);
        const char* n = nullptr;
        api().callback_name(CUPTI_CB_DOMAIN_RUNTIME_API, a->cbid, &n);
        e = {TraceEvent::Kind::HostCall, n ? n : "cuda runtime call", a->start, a->end, a->threadId, 0};
        break;
      }
      case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
        const auto* s = reinterpret_cast<const CUpti_ActivitySynchronization2*>(rec);
        e = {TraceEvent::Kind::Sync, sync_name(s->type), s->start, s->end, s->streamId, 0};
        break;
      }
      default:
        continue;
    }
    got.push_back(std::move(e));
  }
  std::free(buf);
  std::lock_guard lk(g_mu);
  if (g_events) g_events->insert(g_events->end(), got.begin(), got.end());
}

constexpr CUpti_ActivityKind kKinds[] = {CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
                                         CUPTI_ACTIVITY_KIND_MEMSET, CUPTI_ACTIVITY_KIND_RUNTIME,
                                         CUPTI_ACTIVITY_KIND_SYNCHRONIZATION};
std::vector<TraceEvent> g_store;

}  // namespace

bool CuptiTrace::available(std::string* why) {
  if (!api().ok && why) *why = api().why;
  return api().ok;
}

CuptiTrace::CuptiTrace() {
  if (!api().ok) fail_msg("--trace: " + api().why);
  {
    std::lock_guard lk(g_mu);
    if (g_events) fail_msg("--trace: a CUPTI trace is already running");
    g_store.clear();
    g_events = &g_store;
  }
  check(api().register_callbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
  for (CUpti_ActivityKind k : kKinds) check(api().enable(k), "cuptiActivityEnable");
  running_ = true;
}

uint64_t CuptiTrace::now() {
  uint64_t t = 0;
  if (api().ok && api().timestamp(&t) != CUPTI_SUCCESS) t = 0;
  return t;
}

std::vector<TraceEvent> CuptiTrace::stop() {
  if (!running_) return {};
  for (CUpti_ActivityKind k : kKinds) api().disable(k);
  check(api().flush_all(1), "cuptiActivityFlushAll");
  running_ = false;
  std::lock_guard lk(g_mu);
  g_events = nullptr;
  return std::move(g_store);
}

CuptiTrace::~CuptiTrace() {
  if (running_) {
    for (CUpti_ActivityKind k : kKinds) api().disable(k);
    api().flush_all(1);
    std::lock_guard lk(g_mu);
    g_events = nullptr;
  }
}

#else  // built without CUPTI's headers

bool CuptiTrace::available(std::string* why) {
  if (why) *why = "this build has no CUPTI headers (cupti.h)";
  return false;
}
CuptiTrace::CuptiTrace() { fail_msg("--trace: this build has no CUPTI headers (cupti.h)"); }
uint64_t CuptiTrace::now() { return 0; }
CuptiTrace::~CuptiTrace() = default;
std::vector<TraceEvent> CuptiTrace::stop() { return {}; }

#endif

}  // namespace talon::cuda
