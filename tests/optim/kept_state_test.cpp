// Kept state (Note [Kept state] in csrc/optim/flat_layout.cpp): after a freeze, every rank holds
// its share of all the optimizer state, the trainable ranges and the state kept for the frozen
// parameters alike; unfreezing resumes the kept state as an unsharded torch::optim::Adam would.
#include <shardopt/ddp/sharded_ddp.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/optim.h>

#include <string>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

constexpr int kLayers = 12;
constexpr int64_t kWidth = 16;

// kLayers layers of h = tanh(h W^T + b): weights of 256 elements, biases of 16, in module order.
struct Stack : torch::nn::Module {
  Stack() {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);  // the same on every rank (thread)
    for (int l = 0; l < kLayers; ++l) {
      params.push_back(register_parameter("w" + std::to_string(l), at::randn({kWidth, kWidth}, gen) * 0.3));
      params.push_back(register_parameter("b" + std::to_string(l), at::randn({kWidth}, gen) * 0.1));
    }
  }
  at::Tensor forward(at::Tensor x) { return run(params, x); }
  static at::Tensor run(const Params& p, at::Tensor h) {
    for (int l = 0; l < kLayers; ++l) h = at::tanh(at::addmm(p[2 * l + 1], h, p[2 * l].t()));
    return h;
  }
  Params params;
};

// This rank's batch of step `step`: different on every rank.
std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  return {at::randn({4, kWidth}, gen), at::randn({4, kWidth}, gen)};
}

struct Pattern {
  const char* name;
  int first_layer, last_layer;  // frozen: layers [first, last]
};

// Trains 7 steps with `pattern` frozen in steps 2-4, through ShardedDDP (the default path), against
// plain Adam over the all-reduced gradients; after the freeze every rank's state is within 3% of
// 1/world of all the state held.
void train_through_a_freeze(int world, PartitionMode mode, Pattern pattern) {
  run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Stack>();
    Params ref = testing::clone_params(net->params);
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g, OSSOptions().partition(mode));
    ShardedDDP ddp(net, oss);
    ASSERT_EQ(Introspection::split(oss), mode == PartitionMode::kSplit);
    for (int step = 0; step < 7; ++step) {
      const bool frozen_now = step >= 2 && step <= 4;
      for (Params* q : {&net->params, &ref}) {
        for (int l = pattern.first_layer; l <= pattern.last_layer; ++l) {
          (*q)[2 * l].requires_grad_(!frozen_now);
          (*q)[2 * l + 1].requires_grad_(!frozen_now);
        }
      }
      const auto [x, y] = batch(step, g->rank());
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(x, *g));
      ddp.zero_grad();
      ref_opt.zero_grad();
      at::mse_loss(ddp.forward(x), y).backward();
      at::mse_loss(Stack::run(ref, x), y).backward();
      testing::allreduce_grads(ref, *g);
      ref_opt.step();
      oss.step();
      ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5))
          << pattern.name << " frozen at world " << world << ", after step " << step;
      if (step != 4) continue;
      at::Tensor bytes = at::zeros({world}, at::kLong);
      bytes[g->rank()] = oss.local_state_bytes();
      g->allreduce(bytes);
      const double share = static_cast<double>(bytes.sum().item<int64_t>()) / world;
      // Adam keeps 8 bytes per element for every parameter stepped so far: all of them.
      int64_t numel = 0;
      for (const auto& p : ref) numel += p.numel();
      ASSERT_EQ(bytes.sum().item<int64_t>(), 8 * numel) << "no state was lost or duplicated";
      for (int r = 0; r < world; ++r) {
        EXPECT_LE(std::abs(static_cast<double>(bytes[r].item<int64_t>()) - share), 0.03 * share)
            << pattern.name << " frozen at world " << world << (mode == PartitionMode::kSplit ? ", split" : ", whole")
            << ": rank " << r << " holds " << bytes[r].item<int64_t>() << " bytes of state, its share is " << share;
      }
    }
  });
}

TEST(KeptState, EveryRankHoldsItsShareAfterAFreezeAndUnfreezingResumesIt) {
  const Pattern patterns[] = {{"the first half", 0, kLayers / 2 - 1},
                              {"a middle block", 3, 8},
                              {"the last layer", kLayers - 1, kLayers - 1}};
  for (int world : {2, 3, 4}) {
    for (PartitionMode mode : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
      for (const auto& pattern : patterns) {
        SCOPED_TRACE(std::string(pattern.name) + " frozen, world " + std::to_string(world) +
                     (mode == PartitionMode::kSplit ? ", split" : ", whole parameters"));
        train_through_a_freeze(world, mode, pattern);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
