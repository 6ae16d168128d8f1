// The order in which a step's per-sample gradients are summed, fixed by the step's sample
// count alone, so that any split of the samples over processes gives the same bits.
//
// Sample i's gradient is leaf i of a binary tree over [0, 2^levels): a node at level l,
// index k covers samples [k*2^l, (k+1)*2^l), clipped to the step's B samples; its sum is
// left + right (just left when right covers no sample). A process that owns the samples
// [a, b) sums the largest nodes lying inside [a, b) (at most 2*levels of them, using one
// scratch buffer per level), the processes exchange those partial sums, and every process
// finishes the tree from them: fp64 addition is not associative, but the tree is the same
// for one process and for any number, so the result is the same to the bit.
#pragma once
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "util/error.h"

namespace talon::train {

struct TreeNode {
  int level = 0;
  int64_t index = 0;
  int64_t first() const { return index << level; }
  int64_t end(int64_t B) const { return std::min((index + 1) << level, B); }
  bool operator==(const TreeNode& o) const { return level == o.level && index == o.index; }
};

// Levels of the tree over B >= 1 samples (0 for one sample): the root is {levels, 0}.
inline int tree_levels(int64_t B) {
  int l = 0;
  while ((int64_t(1) << l) < B) ++l;
  return l;
}

// The samples of rank r of w: a contiguous block [B*r/w, B*(r+1)/w).
inline std::pair<int64_t, int64_t> rank_block(int64_t B, int r, int w) {
  return {B * r / w, B * (r + 1) / w};
}

// The largest nodes whose samples (clipped at B) all lie in [a, b), in sample order.
inline std::vector<TreeNode> tree_pieces(int64_t B, int64_t a, int64_t b) {
  std::vector<TreeNode> out;
  if (a >= b) return out;
  struct Walk {
    int64_t B, a, b;
    std::vector<TreeNode>& out;
    void go(TreeNode n) {
      const int64_t lo = n.first(), hi = n.end(B);
      if (lo >= hi || hi <= a || lo >= b) return;  // empty, or outside [a, b)
      if (lo >= a && hi <= b) {
        out.push_back(n);
        return;
      }
      go({n.level - 1, 2 * n.index});
      go({n.level - 1, 2 * n.index + 1});
    }
  } w{B, a, b, out};
  w.go({tree_levels(B), 0});
  return out;
}

// The sum of node n into `out` (overwritten). Buf: a gradient buffer; add(dst, src) adds
// src into dst element by element; leaf(i, out) writes sample i's gradient into out
// (overwriting it); known(n) returns a finished partial sum of node n or nullptr;
// scratch(level) is a buffer of that level that this call may overwrite.
template <class Buf, class Add, class Leaf, class Known, class Scratch>
void tree_sum(int64_t B, TreeNode n, Buf& out, Add&& add, Leaf&& leaf, Known&& known, Scratch&& scratch) {
  if (const Buf* k = known(n)) {
    out = *k;
    return;
  }
  if (n.level == 0) {
    TALON_CHECK(n.index < B, "gradient tree: sample {} outside a step of {}", n.index, B);
    leaf(n.index, out);
    return;
  }
  const TreeNode l{n.level - 1, 2 * n.index}, r{n.level - 1, 2 * n.index + 1};
  tree_sum(B, l, out, add, leaf, known, scratch);
  if (r.first() >= B) return;
  Buf& tmp = scratch(n.level);
  tree_sum(B, r, tmp, add, leaf, known, scratch);
  add(out, tmp);
}

// A table of rows (width values each) whose per-sample gradients touch only some rows: the
// tree carries those rows alone, compacted in ascending row order. Summing the compact rows
// adds the same values in the same order as summing the whole table (the rows outside are
// zero in every sample), so the sums are the same to the bit.
struct RowSubset {
  std::vector<int64_t> rows;  // ascending, unique, within [0, n_rows)
  int64_t width = 0;

  // rows: any order, repeats and ids outside [0, n_rows) allowed (dropped).
  RowSubset(std::vector<int64_t> r, int64_t n_rows, int64_t w) : rows(std::move(r)), width(w) {
    std::erase_if(rows, [&](int64_t x) { return x < 0 || x >= n_rows; });
    std::sort(rows.begin(), rows.end());
    rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  }
  size_t size() const { return rows.size() * size_t(width); }
  // out = the subset's rows of the dense table.
  void gather(const std::vector<double>& dense, std::vector<double>& out) const {
    out.resize(size());
    for (size_t k = 0; k < rows.size(); ++k)
      std::copy(dense.begin() + rows[k] * width, dense.begin() + (rows[k] + 1) * width, out.begin() + int64_t(k) * width);
  }
  // Zeroes the subset's rows of the dense table.
  void zero(std::vector<double>& dense) const {
    for (int64_t r : rows) std::fill(dense.begin() + r * width, dense.begin() + (r + 1) * width, 0.0);
  }
  // dense = the compact rows times scale, zero everywhere else.
  void scatter(const std::vector<double>& compact, double scale, std::vector<double>& dense) const {
    std::fill(dense.begin(), dense.end(), 0.0);
    for (size_t k = 0; k < rows.size(); ++k)
      for (int64_t i = 0; i < width; ++i)
        dense[size_t(rows[k] * width + i)] = compact[k * size_t(width) + size_t(i)] * scale;
  }
  // The first row outside the subset with a nonzero value in the dense table, or -1.
  int64_t stray_row(const std::vector<double>& dense) const {
    size_t k = 0;
    for (int64_t r = 0; r * width < int64_t(dense.size()); ++r) {
      if (k < rows.size() && rows[k] == r) {
        ++k;
        continue;
      }
      for (int64_t i = 0; i < width; ++i)
        if (dense[size_t(r * width + i)] != 0.0) return r;
    }
    return -1;
  }
};

}  // namespace talon::train
