// The KV cache page pool (model/kv_pages.h), and the page accounting the CPU decoders keep
// with it (model/decode.h: a forward past the capacity is refused and changes nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "backend/backend.h"
#include "model/decode.h"
#include "model/kv_pages.h"
#include "tests/test_util.h"

using namespace talon;
using namespace talon::testing;

namespace {

// Every invariant of the pool, from its public state: the held pages of all slots and the
// free ones are each page exactly once; table rows hold `held` pages then -1; rows map to
// distinct physical rows inside the pool.
void expect_consistent(const KvPages& p, const std::string& what) {
  std::set<int32_t> seen;
  std::set<int64_t> rows;
  int64_t held = 0;
  for (int s = 0; s < p.n_slots(); ++s) {
    for (int64_t i = 0; i < p.max_pages(); ++i) {
      const int32_t page = p.table()[size_t(s * p.max_pages() + i)];
      if (i < p.held(s)) {
        ASSERT_GE(page, 0) << what;
        ASSERT_LT(page, p.n_pages()) << what;
        ASSERT_TRUE(seen.insert(page).second) << what << ": page " << page << " held twice";
      } else {
        ASSERT_EQ(page, -1) << what << ": slot " << s << " entry " << i;
      }
    }
    held += p.held(s);
    for (int64_t j = 0; j < p.held(s) * p.page_rows(); j += 7) {
      const int64_t r = p.row(s, j);
      ASSERT_GE(r, 0) << what;
      ASSERT_LT(r, p.capacity()) << what;
      ASSERT_TRUE(rows.insert(r).second) << what << ": physical row " << r << " twice";
    }
  }
  EXPECT_EQ(held + p.free_pages(), p.n_pages()) << what;
}

TEST(KvPages, HandsOutPagesInOrderAndMapsRowsThroughThem) {
  KvPages p(3, 40, 16);  // 3 pages a slot (40 rounded up), 9 in the pool
  EXPECT_EQ(p.max_pages(), 3);
  EXPECT_EQ(p.n_pages(), 9);
  EXPECT_EQ(p.capacity(), 144);
  p.resize(1, 20);  // pages 0, 1
  p.resize(0, 1);   // page 2
  EXPECT_EQ(p.held(1), 2);
  EXPECT_EQ(p.row(1, 0), 0);
  EXPECT_EQ(p.row(1, 17), 16 + 1);
  EXPECT_EQ(p.row(0, 5), 2 * 16 + 5);
  EXPECT_NE(error_of([&] { p.row(0, 16); }).find("not in its 1 cache pages"), std::string::npos);
  p.resize(1, 0);  // pages 1 then 0 go back: page 0 comes out first
  p.resize(2, 33);
  EXPECT_EQ((std::vector<int32_t>(p.table().begin() + 6, p.table().end())), (std::vector<int32_t>{0, 1, 3}));
  expect_consistent(p, "after a reuse");
}

TEST(KvPages, CapacityIsWholePagesAndAtLeastOneSequence) {
  EXPECT_EQ(KvPages(4, 100, 16, 120).n_pages(), 7);     // 120 rows: 7 whole pages, one sequence of 100
  EXPECT_EQ(KvPages(2, 100, 16, 10000).n_pages(), 14);  // never more than every slot full
  EXPECT_EQ(KvPages(2, 100, 16).n_pages(), 14);         // 0: every slot full
  const std::string small = error_of([] { KvPages(4, 100, 16, 100); });
  EXPECT_NE(small.find("cannot hold one sequence of max_len 100"), std::string::npos) << small;
  EXPECT_NE(small.find("at least 112 tokens"), std::string::npos) << small;
  EXPECT_NE(error_of([] { KvPages(0, 100, 16); }).find("at least one slot"), std::string::npos);
  EXPECT_NE(error_of([] { KvPages(1, 100, 0); }).find("need at least one"), std::string::npos);
  EXPECT_NE(error_of([] { KvPages(1, 100, 16, -5); }).find("-5 tokens"), std::string::npos);
  EXPECT_NE(error_of([] { KvPages(1 << 20, 4096, 64); }).find("more than 2^31 rows"), std::string::npos);
}

TEST(KvPages, AResizeThatDoesNotFitChangesNothing) {
  KvPages p(3, 64, 16, 96);  // 6 pages, 4 a slot
  p.resize({{0, 40}, {1, 30}});  // 3 + 2 pages
  const std::vector<int32_t> before = p.table();
  // Slot 2 wants 2 pages, slot 1 gives 1 back: 1 free + 1 back = 2, enough.
  p.resize({{1, 10}, {2, 20}});
  expect_consistent(p, "shrink beside growth");
  EXPECT_EQ(p.free_pages(), 0);
  const std::vector<int32_t> full = p.table();
  const std::string e = error_of([&] { p.resize({{1, 10}, {2, 40}}); });
  EXPECT_NE(e.find("the KV cache is full: slot 2 needs 1 more pages"), std::string::npos) << e;
  EXPECT_EQ(p.table(), full);
  EXPECT_NE(error_of([&] { p.resize({{1, 10}, {1, 20}}); }).find("listed twice"), std::string::npos);
  EXPECT_NE(error_of([&] { p.resize(0, 65); }).find("cannot hold 65 tokens"), std::string::npos);
  EXPECT_NE(error_of([&] { p.resize(3, 1); }).find("slot 3 outside [0, 3)"), std::string::npos);
  EXPECT_EQ(p.table(), full);
  (void)before;
}

// The fixed layout: slot s always holds pages s * max_pages + i (a flat cache), with the same
// accounting, and refuses a pool smaller than every slot full.
TEST(KvPages, TheFixedLayoutIsFlat) {
  KvPages p(3, 40, 16, 0, true);
  p.resize({{2, 33}, {0, 5}});
  p.resize(1, 17);
  EXPECT_EQ(p.table(), (std::vector<int32_t>{0, -1, -1, 3, 4, -1, 6, 7, 8}));
  for (int s = 0; s < 3; ++s)
    for (int64_t j = 0; j < p.held(s) * 16; ++j) ASSERT_EQ(p.row(s, j), s * 48 + j);
  EXPECT_EQ(p.free_pages(), 3);
  p.resize(2, 0);
  EXPECT_EQ(p.free_pages(), 6);
  expect_consistent(p, "fixed");
  EXPECT_NE(error_of([] { KvPages(3, 40, 16, 96, true); }).find("fixed page layout needs every slot full"),
            std::string::npos);
}

// Random resizes of random slots against a model of how many pages each holds: the pool
// stays consistent, refusals come exactly when the free pages (plus what the same call gives
// back) fall short, and the dirty list names exactly the slots whose row changed.
TEST(KvPages, RandomResizesKeepThePoolConsistent) {
  std::mt19937 rng(3);
  for (const int64_t page : {1, 3, 16}) {
    KvPages p(5, 50, page, 120);
    std::vector<int64_t> held(5, 0);
    int refused = 0;
    for (int it = 0; it < 3000; ++it) {
      std::vector<std::pair<int, int64_t>> req;
      std::vector<int> slots = {0, 1, 2, 3, 4};
      std::shuffle(slots.begin(), slots.end(), rng);
      const int n = 1 + int(rng() % 3);
      int64_t need = 0, back = 0;
      for (int k = 0; k < n; ++k) {
        const int64_t rows = int64_t(rng() % 51);
        req.emplace_back(slots[size_t(k)], rows);
        const int64_t want = (rows + page - 1) / page, h = held[size_t(slots[size_t(k)])];
        need += std::max<int64_t>(0, want - h);
        back += std::max<int64_t>(0, h - want);
      }
      const std::vector<int32_t> before = p.table();
      const int64_t free_before = p.free_pages();
      const std::string e = error_of([&] { p.resize(req); });
      const std::string what = "page " + std::to_string(page) + ", step " + std::to_string(it);
      std::vector<int> dirty = p.take_dirty();
      if (need > free_before + back) {
        ++refused;
        ASSERT_NE(e.find("the KV cache is full"), std::string::npos) << what << ": " << e;
        ASSERT_EQ(p.table(), before) << what;
        ASSERT_TRUE(dirty.empty()) << what;
      } else {
        ASSERT_EQ(e, "(no error)") << what;
        std::vector<int> want_dirty;
        for (auto [s, rows] : req) {
          const int64_t w = (rows + page - 1) / page;
          if (w != held[size_t(s)]) want_dirty.push_back(s);
          held[size_t(s)] = w;
        }
        std::sort(want_dirty.begin(), want_dirty.end());
        ASSERT_EQ(dirty, want_dirty) << what;
      }
      for (int s = 0; s < 5; ++s) ASSERT_EQ(p.held(s), held[size_t(s)]) << what;
      expect_consistent(p, what);
    }
    EXPECT_GT(refused, 50) << "page " << page << ": the pool should run full now and then";
  }
}

// The CPU decoder keeps the accounting: 3 slots of up to 64 tokens share 64 rows (4 pages of
// 16). A forward past them is refused, naming the full cache, and changes nothing; the slots
// then decode on and give the logits an unconstrained decoder gives for the same tokens.
TEST(KvPages, TheCpuDecoderRefusesPastItsCapacityAndDecodesOn) {
  auto ck = open_checkpoint(golden_fixture("llama_gqa"));
  auto dec = make_cpu_decoder(*ck, 3, 64, 64), ref = make_cpu_decoder(*ck, 3, 64);
  EXPECT_EQ(dec->cache_capacity(), 64);
  EXPECT_EQ(dec->page_rows(), 16);
  EXPECT_EQ(dec->cache_rows(17), 32);
  EXPECT_EQ(ref->cache_capacity(), 3 * 64);
  const int64_t V = dec->config().vocab;
  std::mt19937 rng(9);
  auto ids = [&](int n) {
    std::vector<int32_t> v(static_cast<size_t>(n));
    for (auto& x : v) x = int32_t(rng() % uint32_t(V));
    return v;
  };
  auto both = [&](const std::vector<DecodeRequest>& reqs, const std::string& what) {
    std::vector<float> a(size_t(logits_rows(reqs) * V)), b(a.size());
    dec->forward(reqs, Capture{}, a.data());
    ref->forward(reqs, Capture{}, b.data());
    EXPECT_EQ(a, b) << what;
    for (const auto& r : reqs) {
      dec->commit_all(r.slot);
      ref->commit_all(r.slot);
    }
  };
  both({{0, ids(20), {}, false}, {1, ids(10), {}, false}}, "prefill");  // 2 + 1 pages
  const std::string e = error_of([&] { dec->forward({{2, ids(17), {}, false}}, Capture{}, nullptr); });
  EXPECT_NE(e.find("the KV cache is full: slot 2 needs 2 more pages"), std::string::npos) << e;
  EXPECT_EQ(dec->length(2), 0);
  for (int step = 0; step < 6; ++step) both({{0, ids(1), {}, true}, {1, ids(1), {}, true}}, "step");  // 26, 16
  dec->reset(0);
  ref->reset(0);
  both({{2, ids(30), {}, true}}, "refill after a reset");  // slot 2 takes slot 0's 2 pages
  both({{1, ids(1), {}, true}, {2, ids(1), {}, true}}, "after the refill");  // 17: slot 1 takes the last page
  const std::string e2 = error_of([&] { dec->forward({{2, ids(2), {}, true}}, Capture{}, nullptr); });
  EXPECT_NE(e2.find("the KV cache is full"), std::string::npos) << e2;  // 31 + 2 rows: a third page
  both({{2, ids(1), {}, true}}, "the last row of slot 2's pages");
}

}  // namespace
