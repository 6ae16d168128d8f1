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

// RowSubset: the rows kept (sorted, unique, in range), gather / zero / scatter, and a stray
// row found wherever it is.
TEST(GradTree, RowSubsetKeepsSortedRowsAndFindsStrays) {
  const RowSubset sub({9, 5, -1, 2, 5, 10, 100}, 10, 3);
  EXPECT_EQ(sub.rows, (std::vector<int64_t>{2, 5, 9}));
  EXPECT_EQ(sub.size(), 9u);
  Buf dense(30);
  for (size_t i = 0; i < dense.size(); ++i) dense[i] = double(i) + 0.5;
  Buf compact;
  sub.gather(dense, compact);
  EXPECT_EQ(compact, (Buf{6.5, 7.5, 8.5, 15.5, 16.5, 17.5, 27.5, 28.5, 29.5}));
  EXPECT_EQ(sub.stray_row(dense), 0);
  Buf back(30, -1.0);
  sub.scatter(compact, 2.0, back);
  for (int64_t r = 0; r < 10; ++r)
    for (int64_t i = 0; i < 3; ++i) {
      const bool kept = r == 2 || r == 5 || r == 9;
      EXPECT_EQ(back[size_t(r * 3 + i)], kept ? 2.0 * dense[size_t(r * 3 + i)] : 0.0) << r << "," << i;
    }
  EXPECT_EQ(sub.stray_row(back), -1);
  for (int64_t r : {0, 3, 8}) {
    Buf d = back;
    d[size_t(r * 3 + 2)] = -1e-300;
    EXPECT_EQ(sub.stray_row(d), r);
  }
  sub.zero(back);
  EXPECT_EQ(back, Buf(30, 0.0));
  EXPECT_EQ(RowSubset({}, 10, 3).stray_row(Buf(30, 0.0)), -1);
}

// The tree over compact rows gives the bits of the tree over the whole table, for one
// process and for several: samples touch a few rows each (the rest exactly zero), with
// magnitudes spread so that any change of summation order would show.
TEST(GradTree, RowSubsetSumsAreTheDenseSumsToTheBit) {
  const int64_t n_rows = 50, width = 4, B = 7;
  std::mt19937_64 rng(17);
  std::vector<Buf> dense(static_cast<size_t>(B), Buf(size_t(n_rows * width), 0.0));
  std::vector<int64_t> touched;
  const std::vector<Buf> values = sample_grads(B, size_t(n_rows * width), 18);
  for (int64_t b = 0; b < B; ++b)
    for (int k = 0; k < 6; ++k) {
      const int64_t r = int64_t(rng() % 20);  // rows 0..19 only; 20..49 never touched
      touched.push_back(r);
      for (int64_t i = 0; i < width; ++i)
        dense[size_t(b)][size_t(r * width + i)] = values[size_t(b)][size_t(r * width + i)];
    }
  const RowSubset sub(touched, n_rows, width);
  std::vector<Buf> compact(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) sub.gather(dense[size_t(b)], compact[size_t(b)]);
  const Buf want = split_sum(dense, 1);
  for (int w : {1, 2, 3}) {
    Buf got(want.size(), 7.0);
    sub.scatter(split_sum(compact, w), 1.0, got);
    EXPECT_TRUE(same_bits(got, want)) << w << " processes";
  }
}

}  // namespace
}  // namespace talon::train
