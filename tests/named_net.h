// The test models of model.h as torch::nn::Modules with named parameters, for tests that go
// through ShardedDDP.
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

// The dominant-tensor model (make_dominant_params) as a module: A, D (over 90% of the elements,
// 6,400), C, b.
struct DominantNet : torch::nn::Module {
  DominantNet() {
    auto p = make_dominant_params();
    const char* names[] = {"A", "D", "C", "b"};
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter(names[i], p[i]));
  }
  at::Tensor forward(at::Tensor x) { return dominant_output(params, x); }
  std::vector<at::Tensor> params;
};

}  // namespace shardopt::testing
