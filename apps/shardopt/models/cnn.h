// The small CNN `shardopt train` trains by default: conv1 (1->32, 3x3) and conv2 (32->64, 3x3),
// each followed by ReLU and 2x2 max-pooling, then fc1 (3136->128) with ReLU and fc2 (128->10).
// 421,642 parameters; the names (conv1.weight, ..., fc2.bias) are what --freeze matches.
#pragma once

#include "classifier.h"

#include <torch/csrc/api/include/torch/nn/modules/conv.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>

namespace shardopt::app {

struct Cnn : Classifier {
  Cnn();
  at::Tensor forward(at::Tensor x) override;
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

}  // namespace shardopt::app
