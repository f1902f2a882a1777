// What the checkpoint tests share: the tiny net as a module, its optimizer, its training loop
// (a freeze at steps 2 and 3) and temporary folders.
#pragma once

#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <string>
#include <vector>

namespace shardopt::testing {

using Params = std::vector<at::Tensor>;

constexpr int kGlobalBatch = 12;  // divisible by every world size used here

struct Net : torch::nn::Module {
  Net() {
    auto p = make_params();
    const char* names[] = {"w1", "b1", "w2", "b2", "s"};
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter(names[i], p[i]));
    register_buffer("seen", at::zeros({1}));
  }
  at::Tensor forward(at::Tensor x) { return output(params, x); }
  Params params;
};

inline OptimizerFactory adam() {
  return optimizer<torch::optim::Adam>(torch::optim::AdamOptions(2e-2).weight_decay(0.01));
}

// Steps [from, to) of a run whose global batch is split over the group; w2 and b2 frozen for
// steps 2 and 3 (so a save at step 3 carries a freeze).
inline void train(Net& net, OSS& oss, ShardedDDP& ddp, ProcessGroup& g, int from, int to) {
  const int per_rank = kGlobalBatch / g.size();
  for (int s = from; s < to; ++s) {
    for (int i : {2, 3}) net.params[i].requires_grad_(s < 2 || s > 3);
    ddp.zero_grad(true);
    auto data = rank_data(s, g.rank(), per_rank);
    if (s == 0) ASSERT_TRUE(differs_across_ranks(data.x, g));
    loss_of(ddp.forward(data.x), data, per_rank).backward();
    oss.step();
    at::NoGradGuard no_grad;
    net.named_buffers()["seen"].add_(1);
  }
}

}  // namespace shardopt::testing
