// Loading old state_shard()s with each rank receiving only the ranges it holds (Note [Each rank
// receives its own ranges] in csrc/optim/state_migration.cpp): what a recovery or an admission
// does, here without Resilient and across a change of world size and partition.
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <mutex>
#include <set>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

constexpr int kGlobalBatch = 12;  // divisible by 2 and 3

optim::AdamOptions adam_options() { return optim::AdamOptions(2e-2).betas({0.8, 0.95}).weight_decay(0.01); }

// One step of the global batch split over the group (gradients summed over ranks, so the update
// does not depend on the world size); checks once that every rank's share differs.
void backward_global(const Params& params, int64_t step, ProcessGroup& g) {
  const int per_rank = kGlobalBatch / g.size();
  const testing::Data data = testing::rank_data(step, g.rank(), per_rank);
  if (step == 0) {
    std::set<int64_t> distinct;
    for (const auto& v : g.allgather_ints({static_cast<int64_t>(data.x.sum().item<double>() * 1e6)})) distinct.insert(v[0]);
    EXPECT_EQ(static_cast<int>(distinct.size()), g.size()) << "the ranks' data are not all different";
  }
  testing::loss(params, data, kGlobalBatch).backward();
  testing::allreduce_grads(params, g, /*average=*/false);
}

// Five steps at world 3 (split parameters: every parameter's state in ranges on several ranks),
// each rank's state_shard() kept; the parameters after them.
struct Trained {
  std::vector<torch::IValue> shards = std::vector<torch::IValue>(3);
  Params params;
};

Trained train_at_three() {
  Trained t;
  std::mutex mu;
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, optimizer<optim::Adam>(adam_options()), g, OSSOptions().partition(PartitionMode::kSplit));
    for (int s = 0; s < 5; ++s) {
      oss.zero_grad(true);
      backward_global(p, s, *g);
      oss.step();
    }
    torch::IValue shard = oss.state_shard();
    std::lock_guard<std::mutex> lock(mu);
    t.shards[g->rank()] = shard;
    if (g->rank() == 0) t.params = testing::clone_params(p);
  });
  return t;
}

TEST(StateShards, EachRankReceivesOnlyItsRangesAndTrainsOnLikeTorchOptim) {
  const Trained trained = train_at_three();
  // The reference: plain torch::optim::Adam over the whole global batch, ten steps.
  Params expected = testing::make_params();
  optim::Adam reference(expected, adam_options());
  for (int s = 0; s < 10; ++s) {
    reference.zero_grad();
    testing::loss(expected, testing::global_data(s, 0, kGlobalBatch), kGlobalBatch).backward();
    reference.step();
  }
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::clone_params(trained.params);
    OSS oss(p, optimizer<optim::Adam>(optim::AdamOptions(1.0)), g);  // the options come from the shards
    // Held unevenly, as after a death: rank 0 sends old shards 0 and 2, rank 1 old shard 1.
    std::vector<torch::IValue> held;
    if (g->rank() == 0) held = {trained.shards[0], trained.shards[2]};
    if (g->rank() == 1) held = {trained.shards[1]};
    const RebalanceStats stats =
        oss.load_state_shards(held, trained.shards[0].toGenericDict().at("param_groups"));
    EXPECT_DOUBLE_EQ(oss.param_groups()[0].options().get_lr(), 2e-2);
    // Never more than it holds now; and rank 1, which sends a third of the state, receives some.
    EXPECT_LE(stats.state_bytes_received, oss.local_state_bytes());
    if (g->rank() == 1) EXPECT_GT(stats.state_bytes_received, 0);
    for (int s = 5; s < 10; ++s) {
      oss.zero_grad(true);
      backward_global(p, s, *g);
      oss.step();
    }
    for (size_t i = 0; i < p.size(); ++i) EXPECT_LE(testing::rel_diff(p[i], expected[i]), 1e-5) << "parameter " << i;
    EXPECT_TRUE(testing::same_on_all_ranks(p, *g));
  });
}

TEST(StateShards, AShardLeftOutIsAnErrorOnEveryRankNamingTheParameter) {
  const Trained trained = train_at_three();
  const auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::clone_params(trained.params);
    OSS oss(p, optimizer<optim::Adam>(adam_options()), g);
    std::vector<torch::IValue> held;
    if (g->rank() == 0) held = {trained.shards[0], trained.shards[2]};  // old shard 1 is nowhere
    oss.load_state_shards(held, trained.shards[0].toGenericDict().at("param_groups"));
  });
  ASSERT_EQ(errors.size(), 2u);
  std::vector<std::string> named;  // from "the old shards' state of parameter" on: the same on both ranks
  for (const auto& e : errors) {
    const auto at = e.find("the old shards' state of parameter ");
    ASSERT_NE(at, std::string::npos) << e;
    EXPECT_NE(e.find("(a shard missing or given twice?)"), std::string::npos) << e;
    named.push_back(e.substr(at, e.find('\n', at) - at));
  }
  EXPECT_EQ(named[0], named[1]);
}

// state_shard_view() holds what state_shard() holds, but as the live state: the next step changes
// its tensors, not the copy's.
TEST(StateShards, AViewIsTheLiveStateAndACopyIsNot) {
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, optimizer<optim::Adam>(adam_options()), g, OSSOptions().partition(PartitionMode::kSplit));
    for (int s = 0; s < 2; ++s) {
      oss.zero_grad(true);
      backward_global(p, s, *g);
      oss.step();
    }
    const torch::IValue view = oss.state_shard_view(), copy = oss.state_shard();
    auto tensors = [](const torch::IValue& shard) {
      std::vector<at::Tensor> out;
      for (const auto& range : shard.toGenericDict().at("shard").toList()) {
        for (const auto& entry : range.get().toGenericDict().at("state").toGenericDict()) {
          const c10::IValue& value = entry.value();
          if (value.isTensor() && value.toTensor().numel() > 1) out.push_back(value.toTensor());
        }
      }
      return out;
    };
    const auto viewed = tensors(view), copied = tensors(copy);
    ASSERT_EQ(viewed.size(), copied.size());
    ASSERT_FALSE(viewed.empty());
    const auto kept = testing::clone_params(copied);
    for (size_t i = 0; i < viewed.size(); ++i) EXPECT_TRUE(viewed[i].equal(copied[i])) << "tensor " << i;
    oss.zero_grad(true);
    backward_global(p, 2, *g);
    oss.step();
    for (size_t i = 0; i < viewed.size(); ++i) {
      EXPECT_TRUE(copied[i].equal(kept[i])) << "the copy changed: tensor " << i;
      EXPECT_FALSE(viewed[i].equal(kept[i])) << "the view did not follow the step: tensor " << i;
    }
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
