// The optimizer step in the backward (ShardedDDPOptions::step_in_backward, Note [A step in the
// backward]): each bucket is stepped and its parameter sync started during the backward, as soon
// as its reduction is in. The parameters follow plain torch::optim on all-reduced gradients, are
// bit for bit those of the step after the backward (every optimizer, both partitions, worlds 2-4,
// the bf16 wire, accumulation under no_sync, a freeze and an unfreeze), and what needs every
// gradient first is refused on every rank.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/grad_scaler.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::Introspection;

torch::nn::Sequential make_net() {
  auto net = torch::nn::Sequential(torch::nn::Linear(5, 24), torch::nn::Tanh(), torch::nn::Linear(24, 24),
                                   torch::nn::Tanh(), torch::nn::Linear(24, 24), torch::nn::Tanh(),
                                   torch::nn::Linear(24, 3));
  testing::fill_seeded(net->parameters(), 5);
  return net;
}

// An optimizer for OSS and the same one, plain, for the reference.
struct Kind {
  std::string name;
  OptimizerFactory factory;
  std::function<std::unique_ptr<optim::Optimizer>(std::vector<at::Tensor>)> plain;
};

std::vector<Kind> kinds() {
  const auto adamw = optim::AdamWOptions(1e-2).weight_decay(0.1);
  const auto adam = optim::AdamOptions(1e-2).betas({0.8, 0.95});
  const auto sgd = optim::SGDOptions(0.05).momentum(0.9);
  return {
      {"AdamW", optimizer<optim::AdamW>(adamw), [=](auto p) { return std::make_unique<optim::AdamW>(p, adamw); }},
      {"Adam", optimizer<optim::Adam>(adam), [=](auto p) { return std::make_unique<optim::Adam>(p, adam); }},
      {"SGD", optimizer<optim::SGD>(sgd), [=](auto p) { return std::make_unique<optim::SGD>(p, sgd); }},
  };
}

ShardedDDPOptions ddp_options(bool in_backward, Wire wire) {
  return ShardedDDPOptions().reduce_bucket_bytes(512).bucket_bytes_per_rank(0).gradient_wire(wire).step_in_backward(
      in_backward);
}

// The step's trace after a backward, before step(): every bucket stepped ('s') and its sync
// started ('g'), and the first sync started before the last bucket was stepped.
void expect_stepped_in_the_backward(const OSS& oss, size_t buckets, const std::string& where) {
  const auto& trace = Introspection::bucket_steps(oss);
  size_t stepped = 0, synced = 0, first_sync = trace.size(), last_step = 0;
  for (size_t e = 0; e < trace.size(); ++e) {
    if (trace[e].first == 's') {
      EXPECT_EQ(trace[e].second, static_cast<int64_t>(stepped)) << where << ": buckets step in index order";
      ++stepped;
      last_step = e;
    } else {
      first_sync = std::min(first_sync, e);
      ++synced;
    }
  }
  EXPECT_EQ(stepped, buckets) << where;
  EXPECT_EQ(synced, buckets) << where;
  EXPECT_LT(first_sync, last_step) << where << ": the first all-gather waited for the last bucket's step";
}

// Trains a twin of the net with the step after the backward and one with it in the backward, and
// the plain optimizer on all-reduced gradients; freezes the first layer for steps 2-3.
void train_twins(const Kind& kind, PartitionMode partition, Wire wire, int world) {
  testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto after = make_net(), during = make_net(), ref = make_net();
    OSS oss_after(after->parameters(), kind.factory, g, OSSOptions().partition(partition));
    OSS oss_during(during->parameters(), kind.factory, g, OSSOptions().partition(partition));
    ShardedDDP ddp_after(after.ptr(), oss_after, ddp_options(false, wire));
    ShardedDDP ddp_during(during.ptr(), oss_during, ddp_options(true, wire));
    auto ref_opt = kind.plain(ref->parameters());
    for (int step = 0; step < 6; ++step) {
      const std::string where = kind.name + ", rank " + std::to_string(g->rank()) + ", step " + std::to_string(step);
      const bool frozen = step == 2 || step == 3;
      for (auto* net : {&after, &during, &ref}) (*net)[0]->parameters()[0].requires_grad_(!frozen);
      const auto data = testing::rank_data(step, g->rank(), 3);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      oss_after.zero_grad(true);
      testing::loss_of(ddp_after.forward(data.x), data, 3).backward();
      oss_after.step();
      oss_during.zero_grad(true);
      testing::loss_of(ddp_during.forward(data.x), data, 3).backward();
      expect_stepped_in_the_backward(oss_during, ddp_during.num_buckets(), where);
      oss_during.step();
      for (size_t i = 0; i < after->parameters().size(); ++i) {
        ASSERT_TRUE(torch::equal(during->parameters()[i], after->parameters()[i])) << where << ", parameter " << i;
      }
      if (wire != Wire::kExact) continue;
      ref_opt->zero_grad(true);
      testing::loss_of(ref->forward(data.x), data, 3).backward();
      testing::allreduce_grads(ref->parameters(), *g);
      ref_opt->step();
      ASSERT_TRUE(testing::matches_reference(during->parameters(), ref->parameters(), *g, 1e-5)) << where;
    }
  });
}

TEST(StepInBackward, EveryOptimizerStepsInTheBackwardBitForBitAsAfterIt) {
  for (int world : {2, 3, 4}) {
    for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
      for (const Kind& kind : kinds()) {
        SCOPED_TRACE(kind.name + ", world " + std::to_string(world) +
                     (partition == PartitionMode::kSplit ? ", split" : ", whole"));
        train_twins(kind, partition, Wire::kExact, world);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(StepInBackward, TheBf16WireStepsInTheBackwardBitForBitAsAfterIt) {
  for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    SCOPED_TRACE(partition == PartitionMode::kSplit ? "split" : "whole");
    train_twins(kinds()[0], partition, Wire::kBFloat16, 3);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Two micro-batches under no_sync(), then one outside it: one step, in that backward, with the
// three gradients, as after it.
TEST(StepInBackward, AccumulationUnderNoSyncStepsOnceWithEveryMicroBatch) {
  for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    SCOPED_TRACE(partition == PartitionMode::kSplit ? "split" : "whole");
    testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      const Kind kind = kinds()[0];
      auto after = make_net(), during = make_net();
      OSS oss_after(after->parameters(), kind.factory, g, OSSOptions().partition(partition));
      OSS oss_during(during->parameters(), kind.factory, g, OSSOptions().partition(partition));
      ShardedDDP ddp_after(after.ptr(), oss_after, ddp_options(false, Wire::kExact));
      ShardedDDP ddp_during(during.ptr(), oss_during, ddp_options(true, Wire::kExact));
      for (int step = 0; step < 3; ++step) {
        for (auto [ddp, oss] : {std::pair{&ddp_after, &oss_after}, std::pair{&ddp_during, &oss_during}}) {
          oss->zero_grad(true);
          for (int micro = 0; micro < 3; ++micro) {
            const auto data = testing::rank_data(3 * step + micro, g->rank(), 3);
            if (micro < 2) {
              auto guard = ddp->no_sync();
              testing::loss_of(ddp->forward(data.x), data, 9).backward();
            } else {
              testing::loss_of(ddp->forward(data.x), data, 9).backward();
            }
            // Only the backward outside no_sync() steps.
            if (ddp == &ddp_during) EXPECT_EQ(Introspection::bucket_steps(*oss).empty(), micro < 2 && step == 0);
          }
          oss->step();
        }
        for (size_t i = 0; i < after->parameters().size(); ++i) {
          ASSERT_TRUE(torch::equal(during->parameters()[i], after->parameters()[i])) << "step " << step << ", parameter " << i;
        }
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// A gradient left uncleared since the last step was stepped already: the next backward replaces
// it (the reference clears before every backward).
TEST(StepInBackward, AGradientLeftUnclearedIsReplacedNotAddedTo) {
  for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    SCOPED_TRACE(partition == PartitionMode::kSplit ? "split" : "whole");
    testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      const Kind kind = kinds()[1];
      auto net = make_net(), ref = make_net();
      OSS oss(net->parameters(), kind.factory, g, OSSOptions().partition(partition));
      ShardedDDP ddp(net.ptr(), oss, ddp_options(true, Wire::kExact));
      auto ref_opt = kind.plain(ref->parameters());
      for (int step = 0; step < 4; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        testing::loss_of(ddp.forward(data.x), data, 3).backward();  // never cleared
        oss.step();
        ref_opt->zero_grad(true);
        testing::loss_of(ref->forward(data.x), data, 3).backward();
        testing::allreduce_grads(ref->parameters(), *g);
        ref_opt->step();
        ASSERT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5)) << "step " << step;
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Each refusal: one error on every rank, naming what to change.
void expect_refused_on_every_rank(int world, const std::function<void(std::shared_ptr<ProcessGroup>)>& fn,
                                  const std::string& expected) {
  const auto errors = testing::run_ranks_collect_errors(world, fn, std::chrono::seconds(30));
  for (size_t r = 0; r < errors.size(); ++r) {
    const std::string first_line = errors[r].substr(0, errors[r].find('\n'));  // (then c10's backtrace)
    EXPECT_NE(first_line.find(expected), std::string::npos) << "rank " << r << ": " << first_line;
  }
}

void one_backward(ShardedDDP& ddp, int rank) {
  const auto data = testing::rank_data(0, rank, 3);
  testing::loss_of(ddp.forward(data.x), data, 3).backward();
}

TEST(StepInBackward, WhatNeedsEveryGradientFirstIsRefusedOnEveryRank) {
  auto with_net = [](auto body) {
    return [body](std::shared_ptr<ProcessGroup> g) {
      auto net = make_net();
      OSS oss(net->parameters(), kinds()[0].factory, g);
      ShardedDDP ddp(net.ptr(), oss, ddp_options(true, Wire::kExact));
      body(oss, ddp, g->rank());
    };
  };
  expect_refused_on_every_rank(2, with_net([](OSS& oss, ShardedDDP& ddp, int rank) {
                                 one_backward(ddp, rank);
                                 oss.clip_grad_norm(1.0);
                               }),
                               "clip_grad_norm: this OSS stepped in its ShardedDDP's backward");
  expect_refused_on_every_rank(2, with_net([](OSS& oss, ShardedDDP& ddp, int rank) {
                                 ShardedGradScaler scaler;
                                 const auto data = testing::rank_data(0, rank, 3);
                                 scaler.scale(testing::loss_of(ddp.forward(data.x), data, 3)).backward();
                                 scaler.step(oss);
                               }),
                               "ShardedGradScaler::step: the OSS steps in its ShardedDDP's backward");
  expect_refused_on_every_rank(2, with_net([](OSS&, ShardedDDP& ddp, int rank) {
                                 one_backward(ddp, rank);
                                 one_backward(ddp, rank);  // no step() between
                               }),
                               "began before step() finished the step the last backward began");
  expect_refused_on_every_rank(2, with_net([](OSS&, ShardedDDP& ddp, int rank) {
                                 one_backward(ddp, rank);
                                 ddp.module()->parameters()[0].requires_grad_(false);  // every rank alike
                                 ddp.refresh_trainable();
                               }),
                               "between a backward that stepped the optimizer (ShardedDDPOptions::step_in_backward) "
                               "and step(); call step() first");
}

TEST(StepInBackward, WhatCannotStepInTheBackwardIsRefusedAtConstructionOnEveryRank) {
  auto build = [](OSSOptions oss_options, ShardedDDPOptions options) {
    return [=](std::shared_ptr<ProcessGroup> g) {
      auto net = make_net();
      OSS oss(net->parameters(), kinds()[0].factory, g, oss_options);
      ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions(options).step_in_backward(true));
    };
  };
  expect_refused_on_every_rank(2, build(OSSOptions().fused_step(false), ShardedDDPOptions()),
                               "needs every optimizer to take the fused step (Adam, AdamW or SGD, with "
                               "OSSOptions::fused_step on); on rank 0 optimizer 0 does not");
  expect_refused_on_every_rank(2, build(OSSOptions(), ShardedDDPOptions().auto_refresh_trainable(false)),
                               "step_in_backward needs auto_refresh_trainable on (rank 0 has it off)");
  expect_refused_on_every_rank(4, build(OSSOptions().shard_group_size(2), ShardedDDPOptions()),
                               "step_in_backward with hierarchical sharding");
  expect_refused_on_every_rank(
      3,
      [](std::shared_ptr<ProcessGroup> g) {
        auto net = make_net();
        OSS oss(net->parameters(), kinds()[0].factory, g);
        ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().step_in_backward(g->rank() == 2));
      },
      "ShardedDDPOptions::step_in_backward differs between ranks: rank 0 has false, rank 2 has true");
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
