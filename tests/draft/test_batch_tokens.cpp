// The distinct-token table of a batch (--gpu-batch-embeddings uploads only these rows).
#include <gtest/gtest.h>

#include <random>

#include "draft/batch_tokens.h"
#include "util/error.h"

using namespace talon;

TEST(BatchTokens, EveryRowIndexesItsOwnTokenOnce) {
  const std::vector<int32_t> ids = {5, 3, 5, 0, 9, 3, 3, 7};
  std::vector<int32_t> slot(10, -1);
  BatchTokens bt;
  batch_tokens(ids.data(), int64_t(ids.size()), 10, slot, bt);
  // Token 0 first (the row steps past a sample's end read), then first appearances.
  EXPECT_EQ(bt.toks, (std::vector<int32_t>{0, 5, 3, 9, 7}));
  ASSERT_EQ(bt.index.size(), ids.size());
  for (size_t n = 0; n < ids.size(); ++n) EXPECT_EQ(bt.toks[size_t(bt.index[n])], ids[n]) << "row " << n;
  for (int32_t s : slot) EXPECT_EQ(s, -1) << "scratch left dirty";
}

TEST(BatchTokens, RandomBatchesOverOneScratch) {
  std::mt19937 rng(3);
  const int64_t V = 1000;
  std::vector<int32_t> slot(size_t(V), -1);
  BatchTokens bt;
  for (int rep = 0; rep < 20; ++rep) {
    std::vector<int32_t> ids(size_t(1 + rng() % 300));
    for (auto& x : ids) x = int32_t(rng() % uint32_t(rep % 2 ? 40 : V));  // many repeats, then few
    batch_tokens(ids.data(), int64_t(ids.size()), V, slot, bt);
    std::vector<int> seen(size_t(V), 0);
    for (int32_t t : bt.toks) EXPECT_EQ(seen[size_t(t)]++, 0) << "token " << t << " listed twice";
    for (size_t n = 0; n < ids.size(); ++n) EXPECT_EQ(bt.toks[size_t(bt.index[n])], ids[n]);
    EXPECT_EQ(bt.toks[0], 0);
  }
  for (int32_t s : slot) EXPECT_EQ(s, -1);
}

TEST(BatchTokens, AnIdOutsideTheVocabularyIsRefusedWithItsRow) {
  const std::vector<int32_t> ids = {1, 2, 12, 3};
  std::vector<int32_t> slot(10, -1);
  BatchTokens bt;
  try {
    batch_tokens(ids.data(), 4, 10, slot, bt);
    FAIL() << "accepted an id past the vocabulary";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("token id 12 at row 2"), std::string::npos) << e.what();
  }
  for (int32_t s : slot) EXPECT_EQ(s, -1) << "a refused batch left the scratch dirty";
}
