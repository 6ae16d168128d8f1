#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io/safetensors.h"
#include "util/dtype.h"
#include "util/error.h"

namespace talon::testing {

inline std::string source_dir() { return TALON_SOURCE_DIR; }
// A model fixture made by tools/make_golden.py (tests/fixtures/golden/NAME).
inline std::filesystem::path golden_fixture(const std::string& name) {
  return std::filesystem::path(source_dir()) / "tests/fixtures/golden" / name;
}

inline std::vector<float> read_f32(const st::File& f, const std::string& name) {
  const auto& t = f.get(name);
  std::vector<float> v(static_cast<size_t>(t.numel()));
  convert_to_f32(t.dtype, t.data, v.data(), v.size());
  return v;
}

inline std::vector<int64_t> read_i64(const st::File& f, const std::string& name) {
  const auto& t = f.get(name);
  std::vector<int64_t> v(static_cast<size_t>(t.numel()));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

// A fixture tensor stored exactly as T (no conversion): its values, or none (with a test
// failure naming it) when it is missing or holds a different element size.
template <typename T>
std::vector<T> read_as(const st::File& f, const std::string& name) {
  const auto* t = f.find(name);
  if (!t) {
    ADD_FAILURE() << name << ": not in the fixture";
    return {};
  }
  if (t->nbytes != size_t(t->numel()) * sizeof(T)) {
    ADD_FAILURE() << name << ": " << t->nbytes << " bytes for " << t->numel() << " values of " << sizeof(T);
    return {};
  }
  const T* p = reinterpret_cast<const T*>(t->data);
  return std::vector<T>(p, p + t->numel());
}

// max|got - want| / max|want| (the floor 1e-30 keeps an all-zero `want` from passing anything).
inline double rel_max_diff(const std::vector<double>& got, const std::vector<double>& want) {
  double md = 0, mw = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    md = std::max(md, std::abs(got[i] - want[i]));
    mw = std::max(mw, std::abs(want[i]));
  }
  return md / std::max(mw, 1e-30);
}

// max|a-b| / max(1, max|b|); NaN anywhere -> +inf.
inline double rel_err(const float* a, const float* b, size_t n) {
  double num = 0, den = 1;
  for (size_t i = 0; i < n; ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return INFINITY;
    num = std::max(num, double(std::fabs(a[i] - b[i])));
    den = std::max(den, double(std::fabs(b[i])));
  }
  return num / den;
}

// The message of the talon::Error that fn throws, or "(no error)".
inline std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const talon::Error& e) {
    return e.what();
  }
  return "(no error)";
}

}  // namespace talon::testing
