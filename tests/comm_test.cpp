#include <shardopt/comm.h>

#include "harness.h"

#include <gtest/gtest.h>

namespace shardopt {
namespace {

using testing::run_ranks;

TEST(Comm, CollectivesMoveDataAndCountBytes) {
  run_ranks(3, [](std::shared_ptr<ProcessGroup> g) {
    const int r = g->rank();
    at::Tensor t = at::full({4}, static_cast<float>(r + 1));
    g->allreduce(t);
    EXPECT_TRUE(t.equal(at::full({4}, 6.0f)));

    at::Tensor b = at::full({2}, static_cast<float>(r));
    g->broadcast(b, 2);
    EXPECT_TRUE(b.equal(at::full({2}, 2.0f)));

    at::Tensor red = at::full({3}, 1.0f);
    g->reduce(red, 1);
    if (r == 1) EXPECT_TRUE(red.equal(at::full({3}, 3.0f)));

    std::vector<at::Tensor> outs;
    for (int i = 0; i < 3; ++i) outs.push_back(at::empty({2}));
    g->allgather(outs, at::full({2}, static_cast<float>(10 * r)));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(outs[i].equal(at::full({2}, 10.0f * i)));

    std::vector<at::Tensor> ins;
    for (int i = 0; i < 3; ++i) ins.push_back(at::full({2}, static_cast<float>(i + r)));
    at::Tensor out = at::empty({2});
    g->reduce_scatter(out, ins);
    EXPECT_TRUE(out.equal(at::full({2}, static_cast<float>(3 * r + 3))));

    const auto& s = g->stats();
    EXPECT_EQ(s.calls[CommStats::kAllreduce], 1);
    EXPECT_EQ(s.bytes[CommStats::kAllreduce], 16);
    EXPECT_EQ(s.bytes[CommStats::kAllgather], 3 * 8);
    EXPECT_EQ(s.bytes[CommStats::kReduceScatter], 3 * 8);
  });
}

}  // namespace
}  // namespace shardopt
