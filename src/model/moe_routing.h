// How a DeepSeek-family router scores its experts and picks the top k: config.json's
// `scoring_func` and `topk_method`, parsed once (model/config.cpp) into these and used as
// they are by the CPU reference and the CUDA kernels. Plain enums: nvcc compiles this too.
#pragma once

namespace talon {

enum class MoeScoring { Softmax, Sigmoid };
// Greedy: top k of all experts. GroupLimitedGreedy: groups ranked by their best score.
// NoauxTc: groups ranked by the sum of their top-2 (bias-corrected) scores.
enum class MoeTopk { Greedy, GroupLimitedGreedy, NoauxTc };

// The config.json spellings.
inline const char* moe_scoring_name(MoeScoring s) { return s == MoeScoring::Sigmoid ? "sigmoid" : "softmax"; }
inline const char* moe_topk_name(MoeTopk m) {
  return m == MoeTopk::NoauxTc              ? "noaux_tc"
         : m == MoeTopk::GroupLimitedGreedy ? "group_limited_greedy"
                                            : "greedy";
}

}  // namespace talon
