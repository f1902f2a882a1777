// A step per bucket (Note [A step per bucket] in csrc/optim/oss_step.cpp): OSS steps its holdings
// row bucket by row bucket, in the order the parameter sync sends them, and starts each bucket's
// all-gather as soon as that bucket is stepped, before it steps the next. The parameters still
// follow plain torch::optim::AdamW on all-reduced gradients, with ShardedDDP and without it.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <string>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::Introspection;

torch::nn::Sequential make_net() {
  auto net = torch::nn::Sequential(torch::nn::Linear(5, 24), torch::nn::Tanh(), torch::nn::Linear(24, 24),
                                   torch::nn::Tanh(), torch::nn::Linear(24, 24), torch::nn::Tanh(),
                                   torch::nn::Linear(24, 3));
  testing::fill_seeded(net->parameters(), 3);
  return net;
}

optim::AdamWOptions adamw_options() { return optim::AdamWOptions(1e-2).weight_decay(0.1); }

// What the last step did, bucket by bucket: "s5 g5 s3 g3 ..." (stepped, sync started).
std::string trace_of(const OSS& oss) {
  std::string out;
  for (const auto& [what, k] : Introspection::bucket_steps(oss)) out += std::string(1, what) + std::to_string(k) + " ";
  return out;
}

// Each row bucket is stepped and then its all-gather starts at once, the buckets in descending
// order; so the first bucket's all-gather is in flight before the last bucket is stepped.
void expect_each_bucket_goes_when_stepped(const OSS& oss, size_t at_least, int rank, int step) {
  const auto& trace = Introspection::bucket_steps(oss);
  const std::string where = "rank " + std::to_string(rank) + ", step " + std::to_string(step) + ": " + trace_of(oss);
  ASSERT_GE(trace.size(), 2 * at_least) << where << "(expected at least " << at_least << " row buckets)";
  ASSERT_EQ(trace.size() % 2, 0u) << where;
  for (size_t e = 0; e < trace.size(); e += 2) {
    EXPECT_EQ(trace[e].first, 's') << where;
    EXPECT_EQ(trace[e + 1].first, 'g') << where;
    EXPECT_EQ(trace[e].second, trace[e + 1].second) << where;
    if (e > 0) EXPECT_LT(trace[e].second, trace[e - 2].second) << where;
  }
  // The first all-gather started (trace[1]) before the last bucket was stepped (the second-last entry).
  if (at_least > 1) EXPECT_LT(1u, trace.size() - 2) << where;
}

TEST(BucketStep, EachBucketsAllGatherStartsAsSoonAsThatBucketIsStepped) {
  for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    for (int world : {2, 3}) {
      for (bool with_ddp : {true, false}) {
        SCOPED_TRACE("world " + std::to_string(world) + (partition == PartitionMode::kSplit ? ", split" : ", whole") +
                     (with_ddp ? ", ShardedDDP" : ", OSS alone"));
        testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
          auto net = make_net(), ref = make_net();
          optim::AdamW ref_opt(ref->parameters(), adamw_options());
          OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw_options()), g, OSSOptions().partition(partition));
          std::unique_ptr<ShardedDDP> ddp;
          if (with_ddp) {
            ddp = std::make_unique<ShardedDDP>(net.ptr(), oss,
                                               ShardedDDPOptions().reduce_bucket_bytes(512).bucket_bytes_per_rank(0));
          }
          for (int step = 0; step < 4; ++step) {
            const auto data = testing::rank_data(step, g->rank(), 3);
            if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
            oss.zero_grad(true);
            testing::loss_of(ddp ? ddp->forward(data.x) : net->forward(data.x), data, 3).backward();
            if (!ddp) testing::allreduce_grads(net->parameters(), *g);
            oss.step();
            // (OSS alone cuts one row bucket per buffer; ShardedDDP cuts them at 512 bytes)
            expect_each_bucket_goes_when_stepped(oss, with_ddp ? 3 : 1, g->rank(), step);
            ref_opt.zero_grad(true);
            testing::loss_of(ref->forward(data.x), data, 3).backward();
            testing::allreduce_grads(ref->parameters(), *g);
            ref_opt.step();
            ASSERT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5)) << "step " << step;
          }
        });
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
