// Balance by construction (Note [Row buckets]): under the default partition, after freezing the
// first half of the layers, a middle block, the last layer or all three, every rank's optimizer
// state (trainable rows plus the kept state of the frozen parameters) and owned gradients are
// 1/world of the total, within 1% plus the rounding of each row, at 2, 3, 4 and 16 ranks, and again
// after unfreezing; and a freeze or an unfreeze moves exactly the state whose holder changed
// (the rows are cut again for the new trainable set), once.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <cstdio>
#include <functional>
#include <string>
#include <vector>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;

// 5 -> 64 -> 64 x 6 -> 3 (8 Linear layers, 16 tensors, 25,539 elements).
torch::nn::Sequential deep_net() {
  torch::nn::Sequential made;
  made->push_back(torch::nn::Linear(5, 64));
  for (int k = 0; k < 6; ++k) {
    made->push_back(torch::nn::Tanh());
    made->push_back(torch::nn::Linear(64, 64));
  }
  made->push_back(torch::nn::Tanh());
  made->push_back(torch::nn::Linear(64, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.2);
  return made;
}

struct Freeze {
  std::string name;
  std::function<bool(size_t tensor, size_t tensors)> frozen;
};

int64_t sum_over(ProcessGroup& g, int64_t v, Reduction op = Reduction::kSum) {
  at::Tensor t = at::full({1}, v, at::kLong);
  g.allreduce(t, op);
  return t.item<int64_t>();
}

TEST(RowBalance, EveryRankHoldsItsShareAfterAnyFreeze) {
  const std::vector<Freeze> freezes = {
      {"the first half", [](size_t i, size_t n) { return i < n / 2; }},
      {"a middle block", [](size_t i, size_t n) { return i >= n / 2 - 2 && i < n / 2 + 2; }},
      {"the last layer", [](size_t i, size_t n) { return i + 2 >= n; }},
      {"the first half, a middle block and the last layer",
       [](size_t i, size_t n) { return i < n / 2 || (i >= n / 2 + 2 && i < n / 2 + 4) || i + 2 >= n; }},
  };
  for (int world : {2, 3, 4, 16}) {
    for (const Freeze& freeze : freezes) {
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = deep_net();
        auto params = net->parameters();
        OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(1e-3)), g);
        ShardedDDP ddp(net.ptr(), oss);
        const std::string at = "world " + std::to_string(world) + ", freezing " + freeze.name + ": ";
        ASSERT_TRUE(Introspection::split(oss)) << at << "the default partition gives AdamW row buckets";
        // Each rank's share of the state and of the owned gradients, now.
        auto check_shares = [&](const std::string& where) {
          // AdamW keeps two fp32 tensors per element (and a step count per tensor piece).
          const int64_t state = oss.local_state_bytes(), grads = ddp.local_grad_bytes();
          const int64_t total_state = sum_over(*g, state), total_grads = sum_over(*g, grads);
          const int64_t most_state = sum_over(*g, state, Reduction::kMax);
          const int64_t least_state = sum_over(*g, state, Reduction::kMin);
          const int64_t most_grads = sum_over(*g, grads, Reduction::kMax);
          const int64_t least_grads = sum_over(*g, grads, Reduction::kMin);
          const auto buckets = static_cast<int64_t>(oss.layout().buckets().size());
          // Rows are rounded up (the busiest rank holds at most one element more per bucket, and
          // per kept run); the last rank of a bucket takes what is left (at most world - 1
          // elements less). Step counts: one 8-byte value per piece a rank holds, at most 2 per
          // tensor.
          const double ideal_state = static_cast<double>(total_state) / world;
          const double ideal_grads = static_cast<double>(total_grads) / world;
          const int64_t counts = 2 * 8 * static_cast<int64_t>(params.size());
          EXPECT_LE(most_state, 1.01 * ideal_state + (buckets + 1) * 8 + counts) << where;
          EXPECT_GE(least_state, 0.99 * ideal_state - (buckets + 1) * (world - 1) * 8 - counts) << where;
          EXPECT_LE(most_grads, 1.01 * ideal_grads + buckets * 4) << where;
          EXPECT_GE(least_grads, 0.99 * ideal_grads - buckets * (world - 1) * 4) << where;
          if (g->rank() == 0) {
            std::printf("[ balance ] %s: state %lld..%lld of %lld bytes per rank (ideal %.0f), grads %lld..%lld, "
                        "%lld buckets\n",
                        where.c_str(), static_cast<long long>(least_state), static_cast<long long>(most_state),
                        static_cast<long long>(total_state), ideal_state, static_cast<long long>(least_grads),
                        static_cast<long long>(most_grads), static_cast<long long>(buckets));
          }
        };
        // The state a change of the trainable set moves: the rows are cut again for the new set,
        // and exactly the state whose holder changed travels, once.
        int64_t moves = Introspection::state_moves(oss);
        std::vector<at::Tensor> before;
        auto check_moved = [&](const std::string& where) {
          EXPECT_EQ(Introspection::state_moves(oss), moves + 1) << where << ": one move";
          moves = Introspection::state_moves(oss);
          // AdamW's two fp32 tensors per element whose holder changed.
          const int64_t predicted = 8 * Introspection::holders_changed(before, Introspection::state_holders(oss));
          const int64_t sent = sum_over(*g, oss.last_rebalance().state_bytes_sent);
          const int64_t received = sum_over(*g, oss.last_rebalance().state_bytes_received);
          EXPECT_GT(predicted, 0) << where << ": the new rows change some holders";
          EXPECT_EQ(sent, predicted) << where << ": bytes sent";
          EXPECT_EQ(received, predicted) << where << ": bytes received";
          if (g->rank() == 0) {
            std::printf("[ balance ] %s: moved %lld bytes\n", where.c_str(), static_cast<long long>(sent));
          }
        };
        // Step 0 trains everything; 1 and 2 with `freeze` frozen; 3 and 4 with it unfrozen again.
        for (int step = 0; step < 5; ++step) {
          if (step == 1 || step == 3) {
            before = Introspection::state_holders(oss);
            moves = Introspection::state_moves(oss);
            for (size_t i = 0; i < params.size(); ++i) {
              params[i].requires_grad_(step == 3 || !freeze.frozen(i, params.size()));
            }
          }
          const auto data = testing::rank_data(step, g->rank(), 2);
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 2).backward();
          oss.step();
          if (step == 1) check_moved(at + "the freeze");
          if (step == 3) check_moved(at + "the unfreeze");
          if (step == 2) {
            EXPECT_EQ(Introspection::state_moves(oss), moves) << at << "the step after the freeze moves nothing more";
            check_shares(at + "after the freeze");
          }
          if (step == 4) check_shares(at + "after the unfreeze");
        }
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
