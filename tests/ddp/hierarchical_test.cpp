// Hierarchical sharding (OSSOptions::shard_group_size) at 4 ranks as 2 blocks of 2: the
// all-reduce reference's parameters at every step (clipping, a freeze and an unfreeze), half the
// state per rank, the bytes moved within and across blocks, bad sizes, checkpoints between
// hierarchical and flat layouts.
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/ddp/sharded_ddp.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <mutex>
#include <unistd.h>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

using Net = testing::NamedNet;

OptimizerFactory adam() { return optimizer<optim::Adam>(optim::AdamOptions(1e-2)); }

TEST(Hierarchical, MatchesTheReferenceWithHalfTheStatePerRank) {
  for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
    testing::run_ranks(4, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      Params ref = testing::clone_params(net->params);
      optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
      OSS oss(net->parameters(), adam(), g, OSSOptions().shard_group_size(2).partition(partition));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64).bucket_bytes_per_rank(0));
      ASSERT_EQ(oss.process_group().size(), 2);
      ASSERT_NE(Introspection::replica_group(oss), nullptr);
      EXPECT_EQ(Introspection::replica_group(oss)->global_ranks(), (std::vector<int>{g->rank() % 2, g->rank() % 2 + 2}));
      CommStats block_before, across_before;
      for (int step = 0; step < 6; ++step) {
        if (step == 5) block_before = oss.process_group().stats(), across_before = Introspection::replica_group(oss)->stats();
        const bool frozen = step == 2 || step == 3;
        for (Params* q : {&ref, &net->params}) (*q)[2].requires_grad_(!frozen), (*q)[3].requires_grad_(!frozen);
        auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.clip_grad_norm(0.5);
        oss.step();
        ref_opt.zero_grad(true);
        testing::loss(ref, data, 3).backward();
        testing::allreduce_grads(ref, *g);
        for (auto& p : ref) if (!p.requires_grad()) p.mutable_grad().reset();
        Params with_grad;
        for (auto& p : ref) if (p.grad().defined()) with_grad.push_back(p);
        torch::nn::utils::clip_grad_norm_(with_grad, 0.5);
        ref_opt.step();
        ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5))
            << "step " << step << ", partition " << static_cast<int>(partition);
      }
      // Each rank holds half the state: the block's total over 2.
      at::Tensor bytes = at::full({1}, oss.local_state_bytes(), at::kLong), block = bytes.clone();
      oss.process_group().allreduce(block);
      EXPECT_NEAR(static_cast<double>(bytes.item<int64_t>()) / block.item<int64_t>(), 0.5, 0.03);
      // Gradients move within the block (a reduce to each owner, or a reduce-scatter of each row
      // bucket) and across blocks (all-reduce of owned shards); the parameters within the block.
      const auto& block_stats = oss.process_group().stats();
      const auto& across = Introspection::replica_group(oss)->stats();
      if (partition == PartitionMode::kSplit) {
        EXPECT_GT(block_stats.bytes[CommStats::kReduceScatter], 0);
        EXPECT_GT(block_stats.bytes[CommStats::kAllgather], 0);
        EXPECT_EQ(block_stats.bytes[CommStats::kReduce] + block_stats.bytes[CommStats::kBroadcast], 0);
        // The last step, per row bucket: a reduce-scatter and an all-gather in the block, an
        // all-reduce of this rank's row across the blocks.
        const auto buckets = static_cast<int64_t>(ddp.num_buckets());
        ASSERT_GT(buckets, 2);
        auto calls = [](const CommStats& after, const CommStats& before, CommStats::Kind kind) {
          return after.calls[kind] - before.calls[kind];
        };
        EXPECT_EQ(calls(block_stats, block_before, CommStats::kReduceScatter), buckets);
        EXPECT_EQ(calls(block_stats, block_before, CommStats::kAllgather), buckets);
        EXPECT_EQ(calls(across, across_before, CommStats::kAllreduce), buckets);
      } else {
        EXPECT_GT(block_stats.bytes[CommStats::kReduce], 0);
      }
      EXPECT_GT(across.bytes[CommStats::kAllreduce], 0);
      EXPECT_EQ(across.bytes[CommStats::kBroadcast] + across.bytes[CommStats::kAllgather], 0)
          << "the parameter sync stays in the block";
    });
  }
}

TEST(Hierarchical, ASizeThatDoesNotDivideIsAnErrorOnEveryRank) {
  auto errors = testing::run_ranks_collect_errors(4, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss(testing::make_params(), adam(), g, OSSOptions().shard_group_size(3));
  });
  for (const auto& e : errors) EXPECT_NE(e.find("shard_group_size 3 must divide the group's size 4"), std::string::npos) << e;
  auto disagree = testing::run_ranks_collect_errors(4, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss(testing::make_params(), adam(), g, OSSOptions().shard_group_size(g->rank() == 3 ? 0 : 2));
  });
  for (const auto& e : disagree) EXPECT_NE(e.find("shard_group_size"), std::string::npos) << e;
}

// A checkpoint saved with blocks loads into a flat layout and another world size, and back.
TEST(Hierarchical, CheckpointsLoadBetweenHierarchicalAndFlat) {
  for (auto layout : {OptimizerStateLayout::kConsolidated, OptimizerStateLayout::kSharded}) {
    const std::string path = "/tmp/shardopt-hier-" + std::to_string(::getpid()) + ".ckpt";
    Params saved_params;
    std::mutex mu;
    testing::run_ranks(4, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g, OSSOptions().shard_group_size(2));
      ShardedDDP ddp(net, oss);
      for (int step = 0; step < 3; ++step) {
        ddp.zero_grad();
        auto data = testing::rank_data(step, g->rank(), 3);
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.step();
      }
      save_checkpoint(path, *net, oss, {}, CheckpointOptions().optimizer_state(layout));
      std::lock_guard<std::mutex> lock(mu);
      if (g->rank() == 0) saved_params = testing::clone_params(net->params);
    });
    for (int world : {2, 4}) {
      testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<Net>();
        OSS oss(net->parameters(), adam(), g, OSSOptions().shard_group_size(world == 4 ? 2 : 0));
        load_checkpoint(path, *net, oss);
        for (size_t i = 0; i < saved_params.size(); ++i) EXPECT_TRUE(at::equal(net->params[i], saved_params[i]));
        oss.consolidate_state_dict(0);
        if (oss.process_group().rank() == 0) {
          EXPECT_EQ(oss.state_dict().toGenericDict().at("state").toGenericDict().size(), 5u) << "world " << world;
        }
      });
    }
    ::unlink(path.c_str());
  }
}

}  // namespace
}  // namespace shardopt
