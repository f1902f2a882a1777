#include "cnn.h"

#include <ATen/ATen.h>

namespace shardopt::app {

Cnn::Cnn() {
  conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 32, 3).padding(1)));
  conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 64, 3).padding(1)));
  fc1 = register_module("fc1", torch::nn::Linear(64 * 7 * 7, 128));
  fc2 = register_module("fc2", torch::nn::Linear(128, 10));
}

at::Tensor Cnn::forward(at::Tensor x) {
  x = at::max_pool2d(at::relu(use(conv1)->forward(x)), 2);
  x = at::max_pool2d(at::relu(use(conv2)->forward(x)), 2);
  x = at::relu(use(fc1)->forward(x.flatten(1)));
  return use(fc2)->forward(x);
}

}  // namespace shardopt::app
