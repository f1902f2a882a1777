#include <shardopt/partition.h>

#include <gtest/gtest.h>
#include <c10/util/Exception.h>

namespace shardopt {
namespace {

TEST(Partition, BeatsSortedGreedyWhereItCan) {
  // Sorted greedy puts {5, 3} and {4, 3, 3}: loads 8 and 10. The optimum is 9 and 9.
  auto p = Partition::balance({5, 4, 3, 3, 3}, 2);
  EXPECT_EQ(std::max(p.load(0), p.load(1)), 9);
  EXPECT_DOUBLE_EQ(p.imbalance(), 0.0);
}

TEST(Partition, EveryParameterHasExactlyOneOwnerAndTheResultIsDeterministic) {
  std::vector<int64_t> w;
  for (int i = 0; i < 300; ++i) w.push_back((i * 7919) % 1000 + 1);
  for (int world : {1, 2, 3, 7}) {
    auto a = Partition::balance(w, world), b = Partition::balance(w, world);
    std::vector<int> seen(w.size(), 0);
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(a.shard(r), b.shard(r));
      for (size_t i : a.shard(r)) {
        ++seen[i];
        EXPECT_EQ(a.owner(i), r);
      }
      total += a.load(r);
    }
    for (int s : seen) EXPECT_EQ(s, 1);
    EXPECT_EQ(total, a.total());
    EXPECT_LT(a.imbalance(), 0.01) << "world " << world;
  }
}

TEST(Partition, MoreRanksThanParametersLeavesEmptyShards) {
  auto p = Partition::balance({10, 20}, 4);
  int empty = 0;
  for (int r = 0; r < 4; ++r) empty += p.shard(r).empty();
  EXPECT_EQ(empty, 2);
}

TEST(Partition, RejectsBadInput) {
  EXPECT_THROW(Partition::balance({1, 2}, 0), c10::Error);
  EXPECT_THROW(Partition::balance({1, -2}, 2), c10::Error);
}

}  // namespace
}  // namespace shardopt
