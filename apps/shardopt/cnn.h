// The small CNN `shardopt train` trains: conv1 (1->32, 3x3) and conv2 (32->64, 3x3), each
// followed by ReLU and 2x2 max-pooling, then fc1 (3136->128) with ReLU and fc2 (128->10).
// 421,642 parameters; the names (conv1.weight, ..., fc2.bias) are what --freeze matches.
#pragma once

#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/nn/modules/conv.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>

namespace shardopt::app {

struct CnnImpl : torch::nn::Module {
  CnnImpl();
  at::Tensor forward(at::Tensor x);
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Cnn);

}  // namespace shardopt::app
