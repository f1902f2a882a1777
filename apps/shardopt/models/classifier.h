// The image classifiers `shardopt train --model` trains on Fashion-MNIST: a module whose forward
// maps a batch of 1x28x28 images to 10 logits. Their parameter names are what --freeze matches.
#pragma once

#include <torch/csrc/api/include/torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardopt::app {

struct Classifier : torch::nn::Module {
  virtual at::Tensor forward(at::Tensor images) = 0;
  // Called with each block's parameters before the forward uses them, in the order it uses them:
  // ShardedDDP::wait_param_sync where the parameter sync runs beside the forward (--overlap-sync),
  // so the first block computes while later blocks' parameters are still arriving.
  std::function<void(const std::vector<at::Tensor>&)> before_use;

 protected:
  // `block` (a module holder or a module's shared_ptr), once its parameters may be read.
  template <class M>
  M& use(M& block) {
    if (before_use) before_use(block->parameters());
    return block;
  }
};

// "cnn" (models/cnn.h) or "vit" (models/vit.h), with weights from the global generator.
std::shared_ptr<Classifier> make_classifier(const std::string& name);

}  // namespace shardopt::app
