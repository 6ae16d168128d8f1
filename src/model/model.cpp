#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "util/error.h"

namespace talon {

std::vector<int> default_aux_layers(int64_t L) {
  TALON_CHECK(L >= 4, "default aux layers [2, L/2, L-3] need at least 4 layers, model has {}; pass --layers", L);
  std::vector<int> ids = {2, int(L / 2), int(L - 3)};
  TALON_CHECK(ids[0] < ids[1] && ids[1] < ids[2],
              "default aux layers [2, L/2, L-3] = [{}, {}, {}] are not distinct for L = {}; pass --layers a,b,c",
              ids[0], ids[1], ids[2], L);
  return ids;
}

std::vector<int> parse_layer_ids(const std::string& spec, int64_t L) {
  std::vector<int> ids;
  size_t i = 0;
  while (i <= spec.size()) {
    size_t j = spec.find(',', i);
    if (j == std::string::npos) j = spec.size();
    std::string tok = spec.substr(i, j - i);
    while (!tok.empty() && tok.front() == ' ') tok.erase(tok.begin());
    while (!tok.empty() && tok.back() == ' ') tok.pop_back();
    TALON_CHECK(!tok.empty(), "--layers '{}': empty entry (expected comma-separated integers)", spec);
    size_t used = 0;
    long v = 0;
    try {
      v = std::stol(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TALON_CHECK(used == tok.size() && used > 0, "--layers '{}': '{}' is not an integer", spec, tok);
    TALON_CHECK(v >= 0 && v <= L, "--layers '{}': id {} outside [0, {}] (the model has L = {} layers; ids use the "
                "input-of-layer convention, h[0] = embeddings, h[L] = last layer output)", spec, v, L, L);
    TALON_CHECK(ids.empty() || v > ids.back(), "--layers '{}': ids must be strictly increasing", spec);
    ids.push_back(int(v));
    i = j + 1;
  }
  TALON_CHECK(ids.size() == 3, "--layers '{}': EAGLE-3 needs exactly 3 aux layer ids, got {}", spec, ids.size());
  return ids;
}

void Capture::validate(int64_t n_layers) const {
  TALON_CHECK(layers.size() == out.size(), "capture: {} layer ids but {} outputs", layers.size(), out.size());
  TALON_CHECK(ld.empty() || ld.size() == out.size(), "capture: {} strides for {} outputs", ld.size(), out.size());
  TALON_CHECK(dtype == DType::F32 || dtype == DType::BF16, "capture: dtype {} unsupported", dtype_name(dtype));
  for (int k : layers) TALON_CHECK(k >= 0 && k <= n_layers, "capture: layer id {} outside [0, {}]", k, n_layers);
}

void Capture::validate(int64_t n_layers, const Batch& b) const {
  validate(n_layers);
  TALON_CHECK(seq_dst.empty() || int64_t(seq_dst.size()) == b.n_seqs(),
              "capture: {} sequence destinations for {} sequences", seq_dst.size(), b.n_seqs());
  for (int64_t d : seq_dst) TALON_CHECK(d >= 0, "capture: negative destination row {}", d);
}

int64_t Capture::dst_row(const Batch& b, int64_t s, int64_t r) const {
  return seq_dst.empty() ? r : seq_dst[size_t(s)] + (r - b.seq_start[size_t(s)]);
}

std::vector<int64_t> Capture::dst_rows(const Batch& b) const {
  std::vector<int64_t> dst(static_cast<size_t>(b.n_tokens()));
  for (int64_t s = 0; s < b.n_seqs(); ++s)
    for (int64_t r = b.seq_start[size_t(s)]; r < b.seq_start[size_t(s + 1)]; ++r) dst[size_t(r)] = dst_row(b, s, r);
  return dst;
}

std::vector<int32_t> Batch::positions() const {
  std::vector<int32_t> pos(static_cast<size_t>(n_tokens()));
  for (int64_t s = 0; s < n_seqs(); ++s)
    for (int64_t r = seq_start[size_t(s)]; r < seq_start[size_t(s + 1)]; ++r)
      pos[size_t(r)] = int32_t(r - seq_start[size_t(s)]);
  return pos;
}

std::shared_ptr<uint8_t> Model::host_buffer(size_t bytes) {
  return std::shared_ptr<uint8_t>(new uint8_t[bytes], std::default_delete<uint8_t[]>());
}

void Batch::add(const int32_t* ids, int64_t n) {
  if (seq_start.empty()) seq_start.push_back(0);
  tokens.insert(tokens.end(), ids, ids + n);
  seq_start.push_back(int64_t(tokens.size()));
}

void Batch::clear() {
  tokens.clear();
  seq_start.assign(1, 0);
}

std::vector<float> rope_inv_freq(const RopeConfig& r, int64_t hd) {
  const int64_t half = hd / 2;
  std::vector<float> f(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    // As transformers: exponent 2i/d in fp32, base^e and its reciprocal in fp32.
    const float e = float(2 * i) / float(hd);
    f[size_t(i)] = 1.0f / std::pow(float(r.theta), e);
  }
  if (r.type == "linear") {
    for (auto& x : f) x = x / float(r.factor);
  } else if (r.type == "yarn") {
    // As transformers' YaRN: the correction range [low, high] (in frequency index units)
    // of dims that rotate between beta_fast and beta_slow times over the original context,
    // floored / ceiled; below it frequencies are kept (extrapolated), above it divided by
    // factor (interpolated), with a linear ramp between. fp32 like torch.
    const double base = r.theta, omax = double(r.original_max_position);
    auto corr_dim = [&](double rot) { return double(hd) * std::log(omax / (rot * 2 * std::numbers::pi)) / (2 * std::log(base)); };
    double lo = std::floor(corr_dim(r.beta_fast)), hi = std::ceil(corr_dim(r.beta_slow));
    lo = std::max(lo, 0.0);
    hi = std::min(hi, double(hd - 1));
    if (lo == hi) hi += 0.001;
    for (int64_t i = 0; i < half; ++i) {
      const float ramp = std::clamp((float(i) - float(lo)) / (float(hi) - float(lo)), 0.0f, 1.0f);
      const float extra = 1.0f - ramp;  // weight of the unscaled frequency
      const float pos_freq = std::pow(float(base), float(2 * i) / float(hd));
      const float inv_extra = 1.0f / pos_freq, inv_inter = 1.0f / (float(r.factor) * pos_freq);
      f[size_t(i)] = inv_inter * (1.0f - extra) + inv_extra * extra;
    }
  } else if (r.type == "llama3") {
    const double old_ctx = double(r.original_max_position);
    const double low_wl = old_ctx / r.low_freq_factor, high_wl = old_ctx / r.high_freq_factor;
    for (auto& x : f) {
      const double wl = 2 * std::numbers::pi / x;
      if (wl < high_wl) continue;  // high frequency: unchanged
      if (wl > low_wl) {           // low frequency: scaled
        x = float(x / r.factor);
        continue;
      }
      const double smooth = (old_ctx / wl - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
      x = float((1 - smooth) * x / r.factor + smooth * x);
    }
  }
  if (!r.freq_factors.empty()) {
    TALON_CHECK(int64_t(r.freq_factors.size()) == half, "rope freq_factors: expected {} values, got {}", half,
                r.freq_factors.size());
    for (int64_t i = 0; i < half; ++i) f[size_t(i)] /= r.freq_factors[size_t(i)];
  }
  return f;
}

}  // namespace talon
