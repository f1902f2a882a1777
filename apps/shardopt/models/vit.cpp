#include "vit.h"

#include <ATen/ATen.h>

#include <string>

namespace shardopt::app {

namespace {
using C = VitConfig;
torch::nn::LayerNorm layer_norm() { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({C::kDim})); }
}  // namespace

PatchEmbed::PatchEmbed() {
  patch = register_module("patch", torch::nn::Linear(C::kPatch * C::kPatch, C::kDim));
  cls = register_parameter("cls", at::randn({1, 1, C::kDim}) * 0.02);
  pos = register_parameter("pos", at::randn({1, C::kPatches + 1, C::kDim}) * 0.02);
}

at::Tensor PatchEmbed::forward(const at::Tensor& images) {
  const int64_t b = images.size(0), side = 28 / C::kPatch;
  // (B, rows of patches, patch row, columns of patches, patch column) -> (B, patches, pixels)
  const at::Tensor patches = images.reshape({b, side, C::kPatch, side, C::kPatch})
                                 .permute({0, 1, 3, 2, 4})
                                 .reshape({b, C::kPatches, C::kPatch * C::kPatch});
  return at::cat({cls.expand({b, 1, C::kDim}), patch->forward(patches)}, 1) + pos;
}

Attention::Attention() {
  qkv = register_module("qkv", torch::nn::Linear(C::kDim, 3 * C::kDim));
  proj = register_module("proj", torch::nn::Linear(C::kDim, C::kDim));
}

at::Tensor Attention::forward(const at::Tensor& x) {
  const int64_t b = x.size(0), t = x.size(1);
  // (3, B, heads, tokens, head size)
  const at::Tensor q_k_v = qkv->forward(x).reshape({b, t, 3, C::kHeads, C::kDim / C::kHeads}).permute({2, 0, 3, 1, 4});
  const at::Tensor a = at::scaled_dot_product_attention(q_k_v[0], q_k_v[1], q_k_v[2]);
  return proj->forward(a.transpose(1, 2).reshape({b, t, C::kDim}));
}

Mlp::Mlp() {
  fc1 = register_module("fc1", torch::nn::Linear(C::kDim, C::kHidden));
  fc2 = register_module("fc2", torch::nn::Linear(C::kHidden, C::kDim));
}

at::Tensor Mlp::forward(const at::Tensor& x) { return fc2->forward(at::gelu(fc1->forward(x))); }

VitBlock::VitBlock() {
  norm1 = register_module("norm1", layer_norm());
  attn = register_module("attn", std::make_shared<Attention>());
  norm2 = register_module("norm2", layer_norm());
  mlp = register_module("mlp", std::make_shared<Mlp>());
}

at::Tensor VitBlock::forward(at::Tensor x) {
  x = x + attn->forward(norm1->forward(x));
  return x + mlp->forward(norm2->forward(x));
}

Vit::Vit() {
  embed = register_module("embed", std::make_shared<PatchEmbed>());
  for (int64_t i = 0; i < C::kDepth; ++i) {
    blocks.push_back(register_module("block" + std::to_string(i), std::make_shared<VitBlock>()));
  }
  norm = register_module("norm", layer_norm());
  head = register_module("head", torch::nn::Linear(C::kDim, 10));
}

at::Tensor Vit::forward(at::Tensor images) {
  at::Tensor x = use(embed)->forward(images);
  for (auto& block : blocks) x = use(block)->forward(x);
  x = use(norm)->forward(x).select(1, 0);  // the class token
  return use(head)->forward(x);
}

}  // namespace shardopt::app
