// The test model of model.h as a torch::nn::Module with named parameters (w1, b1, w2, b2, s),
// for tests that go through ShardedDDP.
#pragma once

#include "model.h"

#include <torch/csrc/api/include/torch/nn/module.h>

#include <vector>

namespace shardopt::testing {

struct NamedNet : torch::nn::Module {
  NamedNet() {
    auto p = make_params();
    const char* names[] = {"w1", "b1", "w2", "b2", "s"};
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter(names[i], p[i]));
  }
  at::Tensor forward(at::Tensor x) { return output(params, x); }
  std::vector<at::Tensor> params;
};

}  // namespace shardopt::testing
