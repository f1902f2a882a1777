// GPT-2's shape as a module, for the benchmarks (ddp_bench, survive_bench).
#pragma once

#include "models/gpt2.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/api/include/torch/nn/module.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

namespace shardopt::bench {

// GPT-2's shape (models/gpt2.h) as a module, with the blocks' weights [out, in] as
// at::linear takes them: the same tensors, in the same order and layout, as GPT2Like in
// bench/ddp/peers/ddp_peers.py (nn.Linear). The default is the ~24M-parameter shape.
struct GPT2Like : torch::nn::Module {
  int64_t kD = 512, kVocab = 10000;
  struct Block {
    at::Tensor ln1_w, ln1_b, attn_w, attn_b, proj_w, proj_b, ln2_w, ln2_b, fc_w, fc_b, out_w, out_b;
  };
  GPT2Like(int64_t d = 512, int64_t vocab = 10000, int64_t ctx = 512, int layers = 6) : kD(d), kVocab(vocab) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(0);
    std::vector<at::Tensor> ps;
    for (auto [name, shape] : shardopt::models::gpt2_shapes(d, vocab, ctx, layers)) {
      if (shape.size() == 2 && name != "wte" && name != "wpe") std::swap(shape[0], shape[1]);  // Conv1D's [in, out]
      const bool bias = name.size() > 4 && name.compare(name.size() - 4, 4, "bias") == 0;
      const bool norm = name.find("ln_") != std::string::npos;
      at::Tensor t = bias ? at::zeros(shape).requires_grad_()
                          : norm ? at::ones(shape).requires_grad_() : (at::randn(shape, gen) * (name == "wpe" ? 0.01 : 0.02)).requires_grad_();
      std::replace(name.begin(), name.end(), '.', '_');
      ps.push_back(register_parameter(name, t));
    }
    wte = ps[0];
    wpe = ps[1];
    for (int l = 0; l < layers; ++l) {
      const at::Tensor* b = &ps[2 + 12 * l];
      blocks.push_back({b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11]});
    }
    lnf_w = ps[ps.size() - 2];
    lnf_b = ps.back();
  }
  // Called with each part's parameters before the forward uses them (ShardedDDP::wait_param_sync
  // under --overlap-sync).
  std::function<void(const std::vector<at::Tensor>&)> before_use = [](const std::vector<at::Tensor>&) {};
  at::Tensor forward(at::Tensor tokens) {
    const int64_t t = tokens.size(0);
    before_use({wte, wpe});
    at::Tensor x = at::embedding(wte, tokens) + wpe.narrow(0, 0, t);
    for (auto& b : blocks) {
      before_use({b.ln1_w, b.ln1_b, b.attn_w, b.attn_b, b.proj_w, b.proj_b, b.ln2_w, b.ln2_b, b.fc_w, b.fc_b, b.out_w,
                  b.out_b});
      at::Tensor a = at::layer_norm(x, {kD}, b.ln1_w, b.ln1_b);
      auto qkv = at::linear(a, b.attn_w, b.attn_b).chunk(3, -1);
      at::Tensor att = at::softmax(at::matmul(qkv[0], qkv[1].t()) / std::sqrt(double(kD)), -1);
      x = x + at::linear(at::matmul(att, qkv[2]), b.proj_w, b.proj_b);
      at::Tensor m = at::layer_norm(x, {kD}, b.ln2_w, b.ln2_b);
      x = x + at::linear(at::gelu(at::linear(m, b.fc_w, b.fc_b)), b.out_w, b.out_b);
    }
    before_use({lnf_w, lnf_b});
    return at::matmul(at::layer_norm(x, {kD}, lnf_w, lnf_b), wte.t());
  }
  at::Tensor wte, wpe, lnf_w, lnf_b;
  std::vector<Block> blocks;
};

}  // namespace shardopt::bench
