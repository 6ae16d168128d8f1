// The gradient summation tree (train/grad_tree.h): any split of a step's samples over
// processes gives the bits of one process.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "draft/grad_tree.h"

namespace talon::train {
namespace {

using Buf = std::vector<double>;

// Per-sample "gradients" whose fp64 sums depend on the order: magnitudes spread over many
// binades, so a different association changes the last bits.
std::vector<Buf> sample_grads(int64_t B, size_t n, uint64_t seed) {
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  std::uniform_int_distribution<int> e(-30, 30);
  std::vector<Buf> out(static_cast<size_t>(B), Buf(n));
  for (auto& b : out)
    for (auto& x : b) x = std::ldexp(u(g), e(g));
  return out;
}

bool same_bits(const Buf& a, const Buf& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

// The tree sum of B samples split over w processes as the trainer splits them: each
// process sums its pieces, then the root is finished from every process's pieces.
Buf split_sum(const std::vector<Buf>& g, int w, int* leaf_calls = nullptr) {
  const int64_t B = int64_t(g.size());
  const size_t n = g[0].size();
  auto add = [](Buf& d, Buf& s) {
    for (size_t i = 0; i < d.size(); ++i) d[i] += s[i];
  };
  std::vector<std::pair<TreeNode, Buf>> known;
  for (int r = 0; r < w; ++r) {
    const auto [a, b] = rank_block(B, r, w);
    std::map<int, Buf> scratch;
    auto scr = [&](int l) -> Buf& {
      auto& s = scratch[l];
      s.resize(n);
      return s;
    };
    auto leaf = [&](int64_t i, Buf& out) {
      EXPECT_TRUE(i >= a && i < b) << "process " << r << " of " << w << " asked for sample " << i;
      if (leaf_calls) ++*leaf_calls;
      out = g[size_t(i)];
    };
    auto none = [](TreeNode) -> const Buf* { return nullptr; };
    for (const TreeNode& p : tree_pieces(B, a, b)) {
      Buf out(n);
      tree_sum(B, p, out, add, leaf, none, scr);
      known.emplace_back(p, out);
    }
  }
  std::map<int, Buf> scratch;
  auto scr = [&](int l) -> Buf& {
    auto& s = scratch[l];
    s.resize(n);
    return s;
  };
  auto lookup = [&](TreeNode t) -> const Buf* {
    for (auto& [k, v] : known)
      if (k == t) return &v;
    return nullptr;
  };
  auto no_leaf = [](int64_t i, Buf&) { ADD_FAILURE() << "sample " << i << " was in no piece"; };
  Buf out(n);
  tree_sum(B, TreeNode{tree_levels(B), 0}, out, add, no_leaf, lookup, scr);
  return out;
}

TEST(GradTree, PiecesCoverTheBlockExactlyOnce) {
  for (int64_t B = 1; B <= 40; ++B)
    for (int64_t a = 0; a <= B; ++a)
      for (int64_t b = a; b <= B; ++b) {
        std::vector<int> hits(static_cast<size_t>(B), 0);
        const auto ps = tree_pieces(B, a, b);
        EXPECT_LE(ps.size(), size_t(2 * tree_levels(B) + 1)) << B << " " << a << " " << b;
        int64_t prev_end = a;
        for (const TreeNode& p : ps) {
          EXPECT_EQ(p.first(), prev_end) << "pieces in sample order";
          EXPECT_GT(p.end(B), p.first());
          for (int64_t i = p.first(); i < p.end(B); ++i) ++hits[size_t(i)];
          prev_end = p.end(B);
        }
        for (int64_t i = 0; i < B; ++i) EXPECT_EQ(hits[size_t(i)], i >= a && i < b ? 1 : 0) << B << " " << a << " " << b;
      }
}

TEST(GradTree, AnyProcessCountGivesTheSameBits) {
  for (int64_t B : {1, 2, 3, 5, 7, 8, 12, 16, 31, 33}) {
    const auto g = sample_grads(B, 64, uint64_t(B) * 7 + 1);
    const Buf one = split_sum(g, 1);
    for (int w = 2; w <= B + 2; ++w) EXPECT_TRUE(same_bits(split_sum(g, w), one)) << "B=" << B << " w=" << w;
  }
}

TEST(GradTree, IsThePairwiseTreeAndComputesEverySampleOnce) {
  // Independent statement of the tree: halves of a power-of-two span, an empty right half
  // adding nothing.
  struct Ref {
    const std::vector<Buf>& g;
    Buf sum(int64_t lo, int64_t span) const {
      if (span == 1) return g[size_t(lo)];
      Buf l = sum(lo, span / 2);
      if (lo + span / 2 >= int64_t(g.size())) return l;
      const Buf r = sum(lo + span / 2, span / 2);
      for (size_t i = 0; i < l.size(); ++i) l[i] += r[i];
      return l;
    }
  };
  bool some_order_matters = false;
  for (int64_t B : {1, 3, 6, 9, 17}) {
    const auto g = sample_grads(B, 32, uint64_t(B) + 99);
    int calls = 0;
    const Buf tree = split_sum(g, 3, &calls);
    EXPECT_EQ(calls, B);
    EXPECT_TRUE(same_bits(tree, Ref{g}.sum(0, int64_t(1) << tree_levels(B)))) << B;
    Buf seq = g[0];
    for (int64_t i = 1; i < B; ++i)
      for (size_t k = 0; k < seq.size(); ++k) seq[k] += g[size_t(i)][k];
    some_order_matters |= !same_bits(seq, tree);
  }
  EXPECT_TRUE(some_order_matters) << "the data should make the summation order visible";
}

}  // namespace
}  // namespace talon::train
