// Hierarchical sharding (OSSOptions::shard_group_size) at 4 ranks as 2 blocks of 2: the
// all-reduce reference's parameters at every step (clipping, a freeze and an unfreeze), half the
// state per rank, the bytes moved within and across blocks, bad sizes, checkpoints between
// hierarchical and flat layouts; compressed gradient wires, which compress the block's hop only.
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/comm/wire.h>
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
namespace SHARDOPT_UNITY_ID {

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

// A compressed gradient wire under hierarchical sharding compresses the reduce-scatter within the
// block only; the all-reduce of each owned row across the blocks stays exact, so the two replicas
// of a row (ranks r and r + 2) hold bit-identical reduced gradients. Each owner's gradient is
// within the wire's rounding of the exact mean (each contribution off by at most 2^-9 of its
// largest element in bf16, half an int8 step, max |block| / 254, in int8); the block's
// reduce-scatter moves half the exact wire's bytes (bf16) or less than that (int8), the
// across-block all-reduce the same bytes; every rank's parameters stay equal through a freeze.
TEST(Hierarchical, CompressedGradientWiresCompressTheBlockHopOnly) {
  int64_t block_bytes[3] = {0, 0, 0}, across_bytes[3] = {0, 0, 0};
  for (int w = 0; w < 3; ++w) {
    const Wire wire = w == 0 ? Wire::kExact : w == 1 ? Wire::kBFloat16 : Wire::kInt8;
    SCOPED_TRACE(w == 0 ? "exact" : w == 1 ? "bf16" : "int8");
    testing::run_ranks(4, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g, OSSOptions().shard_group_size(2).partition(PartitionMode::kSplit));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().gradient_wire(wire).reduce_bucket_bytes(64).bucket_bytes_per_rank(0));
      ProcessGroup& block = oss.process_group();
      for (int step = 0; step < 4; ++step) {
        const bool frozen = step == 2;
        net->params[2].requires_grad_(!frozen), net->params[3].requires_grad_(!frozen);
        auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        // The exact mean of every rank's local gradients, and the largest local element.
        Params local = testing::clone_params(net->params);
        testing::loss(local, data, 3).backward();
        double largest = 0;
        for (const auto& p : local) {
          if (p.grad().defined()) largest = std::max(largest, p.grad().abs().max().item<double>());
        }
        at::Tensor top = at::full({1}, largest, at::kDouble);
        g->allreduce(top, Reduction::kMax);
        testing::allreduce_grads(local, *g);  // the mean
        const CommStats block_before = block.stats(), across_before = Introspection::replica_group(oss)->stats();
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        if (step == 0 && g->rank() == 0) {
          block_bytes[w] = block.stats().bytes[CommStats::kReduceScatter] - block_before.bytes[CommStats::kReduceScatter];
          across_bytes[w] = Introspection::replica_group(oss)->stats().bytes[CommStats::kAllreduce] -
                            across_before.bytes[CommStats::kAllreduce];
        }
        const std::vector<at::Tensor> owned = oss.grads(/*owned_only=*/true);
        std::vector<at::Tensor> mine;
        double off = 0;
        for (size_t i = 0; i < net->params.size(); ++i) {
          if (!net->params[i].requires_grad()) continue;
          for (const auto& h : Introspection::holdings(oss, i)) {
            if (h.rank != block.rank()) continue;
            ASSERT_LT(mine.size(), owned.size());
            mine.push_back(owned[mine.size()].reshape(-1));
            const at::Tensor exact = local[i].grad().defined()  // no rank's loss reached it: zeros
                                         ? local[i].grad().reshape(-1).narrow(0, h.in_param.begin, h.in_param.size())
                                         : at::zeros({h.in_param.size()});
            off = std::max(off, (mine.back() - exact).abs().max().item<double>());
          }
        }
        ASSERT_EQ(mine.size(), owned.size());
        const double bound = top.item<double>() * (w == 0 ? 1e-6 : w == 1 ? 1.0 / 512 : 1.0 / 254);
        EXPECT_LE(off, bound * 1.0001 + 1e-7) << "rank " << g->rank() << ", step " << step;
        if (w > 0) EXPECT_GT(off, 1e-7) << "the wire rounded nothing on rank " << g->rank();
        // The replicas of each row (this rank and its partner in the other block) hold the same bits.
        const auto replicas = testing::everyones(*Introspection::replica_group(oss), at::cat(mine));
        EXPECT_TRUE(replicas[0].equal(replicas[1])) << "rank " << g->rank() << ", step " << step;
        oss.step();
        ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g)) << "step " << step;
      }
    });
  }
  EXPECT_EQ(block_bytes[1] * 2, block_bytes[0]);
  EXPECT_LT(block_bytes[2], block_bytes[1]);  // (each 64-byte bucket's row also carries a scale)
  EXPECT_EQ(across_bytes[1], across_bytes[0]);
  EXPECT_EQ(across_bytes[2], across_bytes[0]);
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
    const std::string dir = testing::temp_dir("hier");
    const std::string path = dir + "/run.ckpt";
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
    testing::remove_tree(dir);  // the main file and the sharded layout's parts
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
