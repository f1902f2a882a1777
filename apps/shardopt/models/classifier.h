// The image classifiers `shardopt train --model` trains on Fashion-MNIST: a module whose forward
// maps a batch of 1x28x28 images to 10 logits. Their parameter names are what --freeze matches.
#pragma once

#include <torch/csrc/api/include/torch/nn/module.h>

#include <memory>
#include <string>

namespace shardopt::app {

struct Classifier : torch::nn::Module {
  virtual at::Tensor forward(at::Tensor images) = 0;
};

// "cnn" (models/cnn.h) or "vit" (models/vit.h), with weights from the global generator.
std::shared_ptr<Classifier> make_classifier(const std::string& name);

}  // namespace shardopt::app
