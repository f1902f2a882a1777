// Balance by construction (Note [Row buckets]): under the default partition, after freezing the
// first half of the layers, a middle block or the last layer, every rank's optimizer state
// (trainable rows plus the kept state of the frozen parameters) and owned gradients are 1/world
// of the total, within 1% plus the rounding of each row, at 2, 3, 4 and 16 ranks; and the state
// a freeze moves (the rows are cut again for the new trainable set) is at most the state there
// is, moved once.
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
  };
  for (int world : {2, 3, 4, 16}) {
    for (const Freeze& freeze : freezes) {
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        const std::string where = "world " + std::to_string(world) + ", freezing " + freeze.name;
        auto net = deep_net();
        auto params = net->parameters();
        OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(1e-3)), g);
        ShardedDDP ddp(net.ptr(), oss);
        ASSERT_TRUE(Introspection::split(oss)) << where << ": the default partition gives AdamW row buckets";
        int64_t moved = 0, moves = 0;
        for (int step = 0; step < 3; ++step) {
          if (step == 1) {
            for (size_t i = 0; i < params.size(); ++i) params[i].requires_grad_(!freeze.frozen(i, params.size()));
          }
          const auto data = testing::rank_data(step, g->rank(), 2);
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 2).backward();
          oss.step();
          if (step == 1) moved = oss.last_rebalance().state_bytes_sent, moves = Introspection::state_moves(oss);
        }
        EXPECT_EQ(Introspection::state_moves(oss), moves) << where << ": the step after the freeze moves nothing more";
        // AdamW keeps two fp32 tensors per element (and a step count per tensor piece).
        const int64_t state = oss.local_state_bytes(), grads = ddp.local_grad_bytes();
        const int64_t total_state = sum_over(*g, state), total_grads = sum_over(*g, grads);
        const int64_t most_state = sum_over(*g, state, Reduction::kMax);
        const int64_t least_state = sum_over(*g, state, Reduction::kMin);
        const int64_t most_grads = sum_over(*g, grads, Reduction::kMax);
        const int64_t least_grads = sum_over(*g, grads, Reduction::kMin);
        const auto buckets = static_cast<int64_t>(oss.layout().buckets().size());
        // Rows are rounded up (the busiest rank holds at most one element more per bucket, and per
        // kept run); the last rank of a bucket takes what is left (at most world - 1 elements
        // less). Step counts: one 8-byte value per piece a rank holds, at most 2 per tensor.
        const double ideal_state = static_cast<double>(total_state) / world;
        const double ideal_grads = static_cast<double>(total_grads) / world;
        const int64_t counts = 2 * 8 * static_cast<int64_t>(params.size());
        EXPECT_LE(most_state, 1.01 * ideal_state + (buckets + 1) * 8 + counts) << where;
        EXPECT_GE(least_state, 0.99 * ideal_state - (buckets + 1) * (world - 1) * 8 - counts) << where;
        EXPECT_LE(most_grads, 1.01 * ideal_grads + buckets * 4) << where;
        EXPECT_GE(least_grads, 0.99 * ideal_grads - buckets * (world - 1) * 4) << where;
        // The freeze moved state (the rows are cut again for the new trainable set), never more
        // than there is.
        const int64_t moved_total = sum_over(*g, moved);
        EXPECT_GT(moved_total, 0) << where;
        EXPECT_LE(moved_total, total_state) << where;
        if (g->rank() == 0) {
          std::printf("[ balance ] %s: state %lld..%lld of %lld bytes per rank (ideal %.0f), grads %lld..%lld, "
                      "%lld buckets, freeze moved %lld bytes\n",
                      where.c_str(), static_cast<long long>(least_state), static_cast<long long>(most_state),
                      static_cast<long long>(total_state), ideal_state, static_cast<long long>(least_grads),
                      static_cast<long long>(most_grads), static_cast<long long>(buckets),
                      static_cast<long long>(moved_total));
        }
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace shardopt
