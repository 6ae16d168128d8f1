// Token sampling: greedy, temperature, top-k, top-p, from a seed. Random numbers are a
// pure function of (seed, stream, counter) so a sequence samples the same tokens whether
// it decodes alone or among hundreds (continuous batching), and after a resume.
#pragma once
#include <cstdint>
#include <vector>

namespace talon {

struct SamplingParams {
  double temperature = 0;  // 0: greedy (argmax, ties to the lower id)
  int64_t top_k = 0;       // 0: off
  double top_p = 1.0;      // 1: off
  uint64_t seed = 0;
  bool greedy() const { return temperature <= 0; }
  // Throws naming the field when out of range (temperature < 0, top_p outside (0, 1], top_k < 0).
  void validate() const;
};

// A uniform double in [0, 1) from (seed, stream, counter): splitmix64 mixing.
double uniform01(uint64_t seed, uint64_t stream, uint64_t counter);

// Index of the largest logit (the first of equal ones).
int32_t argmax(const float* logits, int64_t V);

// The distribution sampling draws from: softmax(logits / T) restricted to the top-k ids and
// then to the smallest set of most likely ids whose mass reaches top_p, renormalised. fp64.
// Greedy parameters give the one-hot of argmax.
void sampling_distribution(const float* logits, int64_t V, const SamplingParams& p, std::vector<double>& out);

// Inverse-CDF draw from a (not necessarily normalised) non-negative distribution; u in [0, 1).
int32_t draw(const std::vector<double>& probs, double u);

// One token from logits: argmax when greedy, else a draw with uniform01(seed, stream, counter).
int32_t sample_token(const float* logits, int64_t V, const SamplingParams& p, uint64_t stream, uint64_t counter,
                     std::vector<double>& scratch);

}  // namespace talon
