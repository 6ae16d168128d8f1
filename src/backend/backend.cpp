#include "backend/backend.h"

#include <algorithm>

#include "util/error.h"

namespace talon {

DeviceSpec parse_device(const std::string& spec, bool allow_repeats) {
  DeviceSpec d;
  if (spec == "cpu") return d;
  d.cuda = true;
  if (spec == "cuda") return d;
  const auto bad = [&] { fail("--device '{}': expected cpu, cuda, cuda:N or cuda:N,M,...", spec); };
  if (spec.rfind("cuda:", 0) != 0) bad();
  std::string rest = spec.substr(5);
  size_t i = 0;
  while (i <= rest.size()) {
    const size_t j = std::min(rest.find(',', i), rest.size());
    const std::string tok = rest.substr(i, j - i);
    if (tok.empty() || tok.size() > 4 || tok.find_first_not_of("0123456789") != std::string::npos) bad();
    const int v = std::stoi(tok);
    for (int x : d.devices)
      if (x == v && !allow_repeats) fail("--device '{}': cuda:{} is listed twice", spec, v);
    d.devices.push_back(v);
    i = j + 1;
  }
  return d;
}

std::unique_ptr<Decoder> make_decoder(const Checkpoint& ckpt, const DeviceSpec& dev, int tp, int ep, bool share_gpus,
                                      int n_slots, int64_t max_len, int64_t cache_tokens) {
  TALON_CHECK(tp >= 1 && ep >= 1, "--tp and --ep must be >= 1 (got {} and {})", tp, ep);
  TALON_CHECK(tp == 1 || ep == 1, "--tp {} with --ep {}: use one of them", tp, ep);
  const int n = tp * ep;
  const char* flag = ep > 1 ? "--ep" : "--tp";
  TALON_CHECK(dev.cuda || n == 1, "{} {} needs --device cuda", flag, n);
  if (!dev.cuda) return make_cpu_decoder(ckpt, n_slots, max_len, cache_tokens);
  GpuOptions go;
  go.tp = tp;
  go.ep = ep;
  go.share_devices = share_gpus;
  go.devices = dev.devices;
  if (go.devices.empty())  // cuda: the first n GPUs
    for (int r = 0; r < n; ++r) go.devices.push_back(r);
  if (share_gpus && go.devices.size() == 1)  // --share-gpus on one GPU: every rank on it
    go.devices.assign(size_t(n), go.devices[0]);
  TALON_CHECK(int(go.devices.size()) == n, "{} {} needs {} GPUs (--device cuda:0,1,...), got {}{}", flag, n, n,
              go.devices.size(), n > 1 ? "" : "; give --tp or --ep for several");
  return make_cuda_decoder(ckpt, go, n_slots, max_len, cache_tokens);
}

GpuMemoryPlan plan_gpu_memory(const ModelConfig& c, const GpuOptions& o) {
  const int64_t tp = std::max(1, o.tp), H = c.hidden, I = c.intermediate / tp, hd = c.head_dim;
  const int64_t qd = c.n_heads / tp * hd, kvd = c.n_kv_heads / tp * hd, V = c.vocab;
  GpuMemoryPlan p;
  int64_t w = V * H + (c.tied_embeddings ? 0 : V * H) + H;
  w += c.n_layers * (2 * H + (qd + 2 * kvd) * H + qd * H + 3 * I * H + (c.qkv_bias ? qd + 2 * kvd : 0) +
                     (c.qk_norm ? 2 * hd : 0));
  p.weights = 2 * w;
  // x (fp32), xn, qkv, att, tmp, gate|up, act (bf16), ids/pos/row map, attention tiles.
  const int64_t act = 4 * H + 2 * H + 2 * (qd + 2 * kvd) + 2 * qd + 2 * H + 4 * I + 2 * I + 12 + 1;
  const int64_t cap = o.n_capture * H * int64_t(dtype_size(o.capture_dtype));
  p.per_token = act + cap;
  p.activations = act * o.max_tokens;
  p.captures = cap * o.max_tokens;
  p.reserve = (64ll << 20) + (512ll << 20);  // cuBLASLt workspace + context and allocator slack
  return p;
}

}  // namespace talon
