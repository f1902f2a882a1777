// Fashion-MNIST from its gzipped IDX files (Debian's dataset-fashion-mnist installs them in
// /usr/share/datasets/fashion-mnist).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

namespace shardopt::app {

constexpr const char* kDefaultFashionMnistDir = "/usr/share/datasets/fashion-mnist";

struct FashionMnist {
  at::Tensor train_images, train_labels;  // uint8 [N, 28, 28], int64 [N]
  at::Tensor test_images, test_labels;
};

// Reads the train and t10k splits from `dir`; `train_limit` / `test_limit` > 0 keep only the
// first samples of each. Errors name the folder or the file.
FashionMnist load_fashion_mnist(const std::string& dir, int64_t train_limit = 0, int64_t test_limit = 0);

// Images as the network takes them: float [B, 1, 28, 28], normalised with the training set's
// mean and standard deviation.
at::Tensor normalise(const at::Tensor& images);

}  // namespace shardopt::app
