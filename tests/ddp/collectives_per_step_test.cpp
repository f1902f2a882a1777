// Collectives per step and rank under OSS + ShardedDDP with row buckets (Note [Row buckets]): one
// reduce-scatter and one all-gather per bucket, plus a constant that does not depend on the world
// size, counted from ProcessGroup::stats() at 2, 4, 16 and 64 ranks (threads of this process over
// Gloo) on the same model, while the parameters follow the all-reduce reference through a freeze
// and an unfreeze.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace shardopt {
namespace {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// 5 -> 16 -> 16 -> 16 -> 3: 691 elements in 8 tensors.
torch::nn::Sequential net_of(uint64_t seed) {
  auto made = torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                                    torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
                                    torch::nn::Linear(16, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

optim::AdamWOptions adamw() { return optim::AdamWOptions(1e-2).weight_decay(0.01); }

// What one rank counted over the measured steps.
struct Count {
  int64_t per_step = 0;       // every collective
  int64_t rows_per_step = 0;  // reduce-scatters and all-gathers
  int64_t buckets = 0;
  bool operator==(const Count& o) const {
    return per_step == o.per_step && rows_per_step == o.rows_per_step && buckets == o.buckets;
  }
};

// Steps 0-1 warm up, 2-3 freeze the first layer, 4-5 unfreeze it; steps 1, 3 and 5 are counted
// (the first step of each trainable set lays out and rebuilds, which counts apart).
std::map<int, std::vector<Count>> count_at(const std::vector<int>& worlds, const ShardedDDPOptions& options) {
  std::map<int, std::vector<Count>> out;
  std::mutex mu;
  for (int world : worlds) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = net_of(5), ref_net = net_of(5);
      Params params = net->parameters(), ref = ref_net->parameters();
      OSS oss(params, optimizer<optim::AdamW>(adamw()), g);
      ShardedDDP ddp(net.ptr(), oss, options);
      optim::AdamW ref_opt(ref, adamw());
      ASSERT_TRUE(oss.layout().groups().at(0).split) << "the default partition splits AdamW's parameters";
      Count c;
      for (int step = 0; step < 6; ++step) {
        const bool frozen = step == 2 || step == 3;
        params[0].requires_grad_(!frozen), ref[0].requires_grad_(!frozen);
        const auto data = testing::rank_data(step, g->rank(), 1);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        const CommStats before = g->stats();
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 1).backward();
        oss.step();
        const CommStats& after = g->stats();
        if (step % 2 == 1) {
          c.per_step += after.total_calls() - before.total_calls();
          c.rows_per_step += after.calls[CommStats::kReduceScatter] - before.calls[CommStats::kReduceScatter] +
                             after.calls[CommStats::kAllgather] - before.calls[CommStats::kAllgather];
          c.buckets += static_cast<int64_t>(ddp.num_buckets());
        }
        ref_opt.zero_grad(true);
        testing::loss_of(ref_net->forward(data.x), data, 1).backward();
        testing::allreduce_grads(ref, *g);
        ref_opt.step();
        ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << "world " << world << ", step " << step;
      }
      std::lock_guard<std::mutex> lock(mu);
      out[world].push_back(c);
    });
    if (::testing::Test::HasFatalFailure()) return out;
  }
  return out;
}

void expect_flat_in_world_size(const std::map<int, std::vector<Count>>& counts, int64_t min_buckets) {
  const Count& at_four = counts.at(4).front();
  EXPECT_GE(at_four.buckets, min_buckets * 3);
  // One reduce-scatter and one all-gather per bucket.
  EXPECT_EQ(at_four.rows_per_step, 2 * at_four.buckets);
  // The rest (the trainability check, the clearing evidence): a small constant.
  EXPECT_LE(at_four.per_step - at_four.rows_per_step, 3 * 3);
  for (const auto& [world, ranks] : counts) {
    for (const Count& c : ranks) {
      EXPECT_TRUE(c == at_four) << "world " << world << ": " << c.per_step << " collectives over 3 steps ("
                                << c.rows_per_step << " reduce-scatters and all-gathers, " << c.buckets
                                << " buckets); at world 4: " << at_four.per_step << " (" << at_four.rows_per_step
                                << ", " << at_four.buckets << ")";
    }
  }
}

TEST(CollectivesPerStep, DoNotGrowWithTheWorldSize) {
  // Buckets of 1 KiB whatever the world size: several row buckets, the same ones at every size.
  const auto fixed = count_at({2, 4, 16, 64}, ShardedDDPOptions().reduce_bucket_bytes(1024).bucket_bytes_per_rank(0));
  if (::testing::Test::HasFatalFailure()) return;
  expect_flat_in_world_size(fixed, 2);
  // The default rule (bucket_bytes_for: at least 8 MiB, 1 MiB more per rank): one bucket.
  const auto by_default = count_at({2, 4, 16, 64}, ShardedDDPOptions());
  if (::testing::Test::HasFatalFailure()) return;
  expect_flat_in_world_size(by_default, 1);
}

}  // namespace
}  // namespace shardopt
