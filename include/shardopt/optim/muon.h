// Muon: PyTorch 2.11's torch.optim.Muon in C++, with the same options, defaults, results and
// errors.
//
//   shardopt::Muon opt(hidden_matrices, shardopt::MuonOptions(0.02).adjust_lr_fn("match_rms_adamw"));
//
// For each 2-D parameter with a gradient G (Note [Muon's step] in csrc/optim/muon.cpp):
//   B <- momentum * B + (1 - momentum) * G                       (momentum_buffer, starts at 0)
//   U <- nesterov ? G + momentum * (B - G) : B
//   O <- Newton-Schulz(U): ns_steps quintic iterations with ns_coefficients (a, b, c), in
//        bfloat16, on U / max(||U||_F, eps), the short side first
//   p <- p * (1 - lr * weight_decay) - adjusted_lr * O
// where adjusted_lr is lr * sqrt(max(1, rows / cols)) ("original", the default) or
// lr * 0.2 * sqrt(max(rows, cols)) ("match_rms_adamw"). A parameter without a gradient is not
// touched, not even by weight decay. Muon is meant for hidden layers' weight matrices; embeddings,
// the output head, norms and biases take another optimizer (AdamW).
#pragma once

#include <torch/csrc/api/include/torch/arg.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt {

struct MuonOptions : public torch::optim::OptimizerCloneableOptions<MuonOptions> {
  MuonOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch::optim's options
  TORCH_ARG(double, lr) = 1e-3;
  TORCH_ARG(double, weight_decay) = 0.1;
  TORCH_ARG(double, momentum) = 0.95;
  TORCH_ARG(bool, nesterov) = true;
  // (a, b, c) of the iteration X <- a X + (b A + c A^2) X, A = X X^T; exactly three.
  TORCH_ARG(std::vector<double>, ns_coefficients) = {3.4445, -4.775, 2.0315};
  TORCH_ARG(double, eps) = 1e-7;
  TORCH_ARG(int64_t, ns_steps) = 5;  // fewer than 100
  // "original" (PyTorch's default, written None there) or "match_rms_adamw".
  TORCH_ARG(std::string, adjust_lr_fn) = "original";
  // shardopt's own, off by default (torch.optim.Muon has none): a parameter of more than two
  // dimensions (a convolution's weight) is taken as the matrix (size(0), the rest), as Keller
  // Jordan's Muon takes conv filters; its state keeps the parameter's shape.
  TORCH_ARG(bool, flatten) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const MuonOptions& lhs, const MuonOptions& rhs);
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct MuonParamState : public torch::optim::OptimizerCloneableParamState<MuonParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  friend bool operator==(const MuonParamState& lhs, const MuonParamState& rhs);
};

class Muon : public torch::optim::Optimizer {
 public:
  // Every parameter must be 2-D (or more, with flatten), and the options as torch.optim.Muon takes them (lr, momentum,
  // weight_decay >= 0; adjust_lr_fn one of the two names); errors name the bad value.
  explicit Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults = {});
  explicit Muon(std::vector<at::Tensor> params, MuonOptions defaults = {});

  // Steps every parameter that has a gradient. A complex parameter, a sparse gradient, ns_steps
  // of 100 or more or other than three coefficients are errors, as in PyTorch.
  at::Tensor step(LossClosure closure = nullptr) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
};

// The learning rate Muon applies to a parameter of `sizes` (rows, cols; more dimensions count as
// columns) for `fn`; an unknown name leaves `lr` as it is, as PyTorch's _adjust_lr does.
double muon_adjusted_lr(double lr, const std::string& fn, at::IntArrayRef sizes);

// The cost of one Newton-Schulz iteration on a matrix of `sizes`, s^2 (2 l + s) multiply-adds
// with s and l its short and long side (Note [Muon's cost]): what OSS balances Muon's owners by.
double muon_cost(at::IntArrayRef sizes);

// The orthogonalised update of a 2-D `update`: PyTorch's _zeropower_via_newtonschulz, in
// bfloat16 (the result is bfloat16).
at::Tensor muon_orthogonalize(const at::Tensor& update, const std::vector<double>& ns_coefficients,
                              int64_t ns_steps, double eps);

}  // namespace shardopt
