#include <shardopt/optim/partition.h>

#include <gtest/gtest.h>
#include <c10/util/Exception.h>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

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
  EXPECT_THROW(Partition::balance({1, 2}, 2, {1}), c10::Error);
}

// After freezing every other tensor of a model whose all-parameter partition is balanced, the
// trainable work is lopsided; the trainable-first partition balances the work and still spreads
// the frozen tensors' state by total weight.
TEST(Partition, TrainableFirstBalancesTheStepAndSpreadsTheRest) {
  std::vector<int64_t> w;
  std::vector<uint8_t> trainable;
  for (int i = 0; i < 40; ++i) {
    w.push_back(i % 2 ? 100 : 10 + i);
    trainable.push_back(i % 4 < 2);
  }
  const auto all = Partition::balance(w, 2);
  const auto freeze_aware = Partition::balance(w, 2, trainable);
  EXPECT_LT(freeze_aware.imbalance(w, trainable), 0.02);
  EXPECT_LT(freeze_aware.imbalance(w, trainable), all.imbalance(w, trainable));
  EXPECT_DOUBLE_EQ(freeze_aware.imbalance(), freeze_aware.imbalance(w, trainable));
  int64_t held[2] = {0, 0};
  for (size_t i = 0; i < w.size(); ++i) held[freeze_aware.owner(i)] += w[i];
  EXPECT_LT(std::abs(held[0] - held[1]), 100) << "frozen tensors go where the least weight is held";

  const std::vector<uint8_t> none_frozen(w.size(), 1);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Partition::balance(w, 2, none_frozen).shard(r), all.shard(r));
}

// Freezing the embeddings of a GPT-2-shaped model (token 10000 x 512, position 512 x 512, six
// blocks) leaves the all-parameter partition lopsided for the trainable work. rebalance() fixes
// that from where it is: frozen tensors never move, and fewer tensors change owner than a
// partition computed afresh would move.
TEST(Partition, RebalanceFromTheCurrentPartitionMovesLittle) {
  const int64_t d = 512;
  std::vector<int64_t> w{10000 * d, 512 * d};
  for (int l = 0; l < 6; ++l) {
    for (int64_t n : {d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d}) w.push_back(n);
  }
  w.push_back(d), w.push_back(d);
  std::vector<uint8_t> trainable(w.size(), 1);
  trainable[0] = trainable[1] = 0;
  const auto before = Partition::balance(w, 2);
  ASSERT_GT(before.imbalance(w, trainable), 0.2) << "the scenario needs a lopsided start";
  const auto after = Partition::rebalance(before, w, trainable);
  EXPECT_LT(after.imbalance(w, trainable), 0.01);
  EXPECT_DOUBLE_EQ(after.imbalance(), after.imbalance(w, trainable));
  EXPECT_EQ(after.owner(0), before.owner(0));
  EXPECT_EQ(after.owner(1), before.owner(1));
  const auto fresh = Partition::balance(w, 2, trainable);
  int moved = 0, fresh_moved = 0;
  for (size_t i = 0; i < w.size(); ++i) {
    moved += after.owner(i) != before.owner(i);
    fresh_moved += fresh.owner(i) != before.owner(i);
  }
  EXPECT_GT(moved, 0);
  EXPECT_LT(moved, fresh_moved);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(Partition::rebalance(after, w, trainable).shard(r), after.shard(r)) << "stable";
}

// Frozen parameters with state move until every rank holds its share in all; trainable ones stay
// where they are, and so do frozen ones without state.
TEST(Partition, SpreadKeptBalancesTheStateHeldWithoutMovingTrainableOnes) {
  const std::vector<int64_t> w = {4, 4, 4, 4, 9};  // parameter 4: frozen from the start, no state
  const auto start = Partition::balance(w, 2, {1, 1, 1, 1, 0});
  // Freeze rank 0's two trainable parameters, after they were stepped; the trainable work is
  // rebalanced (one parameter moves to rank 0), which leaves rank 0 holding 12 of 16 in all.
  std::vector<uint8_t> trainable = {1, 1, 1, 1, 0}, kept(5, 0);
  for (size_t i = 0; i < 4; ++i) {
    if (start.owner(i) == 0) trainable[i] = 0, kept[i] = 1;
  }
  const auto balanced = Partition::rebalance(start, w, trainable);
  ASSERT_DOUBLE_EQ(balanced.imbalance(w, trainable), 0.0);
  ASSERT_DOUBLE_EQ(balanced.held_imbalance(w, trainable, kept), 0.5);
  const auto spread = Partition::spread_kept(balanced, w, trainable, kept);
  EXPECT_DOUBLE_EQ(spread.held_imbalance(w, trainable, kept), 0.0);
  for (size_t i = 0; i < w.size(); ++i) {
    if (!kept[i]) EXPECT_EQ(spread.owner(i), balanced.owner(i)) << "parameter " << i << " moved";
  }
  EXPECT_DOUBLE_EQ(spread.imbalance(w, trainable), 0.0);
  EXPECT_EQ(spread.load(0) + spread.load(1), 8) << "loads count the trainable weight";
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
