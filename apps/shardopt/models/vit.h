// A small Vision Transformer for Fashion-MNIST (`shardopt train --model vit`): each 28x28 image
// is cut into 16 patches of 7x7 pixels, each patch embedded to 64 numbers, a class token put in
// front and a learned position added (embed.*); then four pre-norm transformer blocks (block0 ..
// block3: norm1, attention with 4 heads of 16 (attn.qkv, attn.proj), norm2, an MLP of 128 with
// GELU (mlp.fc1, mlp.fc2)), a final norm, and head (64 -> 10) on the class token. 139,018
// parameters in 56 tensors; --freeze embed@E --freeze block0@E freezes the embedding and the
// first block.
#pragma once

#include "classifier.h"

#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/modules/normalization.h>

#include <vector>

namespace shardopt::app {

struct VitConfig {
  static constexpr int64_t kPatch = 7, kPatches = 16, kDim = 64, kHeads = 4, kDepth = 4, kHidden = 128;
};

// The patches' embedding, the class token and the positions.
struct PatchEmbed : torch::nn::Module {
  PatchEmbed();
  at::Tensor forward(const at::Tensor& images);  // (B, 28, 28) or (B, 1, 28, 28) -> (B, 17, 64)
  torch::nn::Linear patch{nullptr};
  at::Tensor cls, pos;
};

struct Attention : torch::nn::Module {
  Attention();
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
};

struct Mlp : torch::nn::Module {
  Mlp();
  at::Tensor forward(const at::Tensor& x);
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct VitBlock : torch::nn::Module {
  VitBlock();
  at::Tensor forward(at::Tensor x);
  torch::nn::LayerNorm norm1{nullptr}, norm2{nullptr};
  std::shared_ptr<Attention> attn;
  std::shared_ptr<Mlp> mlp;
};

struct Vit : Classifier {
  Vit();
  at::Tensor forward(at::Tensor images) override;
  std::shared_ptr<PatchEmbed> embed;
  std::vector<std::shared_ptr<VitBlock>> blocks;
  torch::nn::LayerNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};

}  // namespace shardopt::app
