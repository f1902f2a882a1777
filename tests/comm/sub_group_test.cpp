// ProcessGroup::split: membership and order, collectives among members only, nested and
// overlapping sub-groups, disagreeing member lists, errors that name global ranks.
#include <shardopt/comm/process_group.h>

#include "harness.h"

#include <gtest/gtest.h>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::run_ranks;

TEST(SubGroup, MembersGetRanksInListOrderAndOthersGetNull) {
  run_ranks(4, [](std::shared_ptr<ProcessGroup> g) {
    auto sub = g->split({3, 1});
    if (g->rank() == 0 || g->rank() == 2) {
      EXPECT_EQ(sub, nullptr);
      return;
    }
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), g->rank() == 3 ? 0 : 1);
    EXPECT_EQ(sub->global_ranks(), (std::vector<int>{3, 1}));
    EXPECT_EQ(sub->global_rank(), g->rank());
    EXPECT_EQ(sub->timeout(), g->timeout());
    // Only members take part: the sum of their global ranks.
    at::Tensor t = at::full({1}, static_cast<double>(g->rank()), at::kDouble);
    sub->allreduce(t);
    EXPECT_EQ(t.item<double>(), 4.0);
    EXPECT_EQ(sub->stats().calls[CommStats::kAllreduce], 1);
  });
}

TEST(SubGroup, NestedAndOverlappingGroupsLiveAtOnce) {
  run_ranks(4, [](std::shared_ptr<ProcessGroup> g) {
    auto low = g->split({0, 1, 2});   // ranks 1 and 2 are in both
    auto high = g->split({1, 2, 3});
    const int r = g->rank();
    ASSERT_EQ(low != nullptr, r <= 2);
    ASSERT_EQ(high != nullptr, r >= 1);
    for (int round = 0; round < 3; ++round) {  // interleaved on the ranks in both
      if (low) {
        at::Tensor t = at::full({1}, 1.0 + r, at::kDouble);
        low->allreduce(t);
        EXPECT_EQ(t.item<double>(), 1.0 + 2.0 + 3.0);
      }
      if (high) {
        at::Tensor t = at::full({2}, static_cast<double>(r), at::kDouble);
        high->broadcast(t, 2);  // high's rank 2 is global rank 3
        EXPECT_EQ(t[1].item<double>(), 3.0);
      }
    }
    // A split of a split: global ranks follow through.
    std::shared_ptr<ProcessGroup> pair = high ? high->split({2, 0}) : nullptr;
    if (r == 3 || r == 1) {
      ASSERT_NE(pair, nullptr);
      EXPECT_EQ(pair->global_ranks(), (std::vector<int>{3, 1}));
      at::Tensor t = at::full({1}, static_cast<double>(r), at::kDouble);
      pair->allreduce(t);
      EXPECT_EQ(t.item<double>(), 4.0);
    } else {
      EXPECT_EQ(pair, nullptr);
    }
  });
}

TEST(SubGroup, ARankWithAnotherListFailsEveryRankNamingTheLists) {
  auto errors = testing::run_ranks_collect_errors(3, [](std::shared_ptr<ProcessGroup> g) {
    g->split(g->rank() == 2 ? std::vector<int>{0, 2} : std::vector<int>{0, 1});
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("the ranks passed different member lists"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1: [0, 1]; rank 2: [0, 2]"), std::string::npos) << errors[r];
  }
  auto bad = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) { g->split({0, 0}); });
  for (int r = 0; r < 2; ++r) EXPECT_NE(bad[r].find("rank 0 is listed twice"), std::string::npos) << bad[r];
}

TEST(SubGroup, ErrorsInASubGroupNameGlobalRanks) {
  auto errors = testing::run_ranks_collect_errors(
      4,
      [](std::shared_ptr<ProcessGroup> g) {
        auto sub = g->split({2, 3});
        // Every rank has connected its sub-group before rank 3 leaves: what fails is the
        // collective, not the connection.
        g->barrier();
        if (!sub || g->rank() == 3) return;  // global rank 3 leaves the sub-group's collective
        at::Tensor t = at::ones({1});
        sub->allreduce(t);
      },
      std::chrono::milliseconds(1500));
  // (with the desync check on, the check's all-reduce is the collective that fails)
  EXPECT_NE(errors[2].find("allreduce #1 of the sub-group of global ranks [2, 3] (this is global rank 2)"),
            std::string::npos) << errors[2];
  EXPECT_NE(errors[2].find("rank 1 (global rank 3) stopped answering"), std::string::npos) << errors[2];
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
