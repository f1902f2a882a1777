#include <shardopt/optim/muon.h>

#include <shardopt/optim/state_layout.h>

#include "optim/codec.h"

#include <ATen/ATen.h>
#include <c10/util/accumulate.h>
#include <torch/csrc/api/include/torch/optim/serialize.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <utility>
#include <vector>

namespace shardopt {

// Note [Muon's step]
// The same operations as torch/optim/_muon.py of PyTorch 2.11, in the same order and dtypes, so
// that a step on the CPU gives the same bits as Python's with the same thread count:
// buf.lerp_(grad, 1 - momentum); update = grad.lerp(buf, momentum) (Nesterov) or buf; the
// Newton-Schulz iteration on update.bfloat16() (transposed when it has more rows than columns),
// divided by its Frobenius norm (linalg.vector_norm, as Tensor.norm() calls it) clamped below at
// eps, then ns_steps times A = X X^T, B = b A + c A A, X = a X + B X (addmm); then the parameter
// decays by 1 - lr * weight_decay (the learning rate before adjustment) and takes the bfloat16
// update times -adjusted_lr in its own dtype. The momentum buffer is zeros like the first
// gradient. The errors are PyTorch's messages, raised where PyTorch raises them: options and
// shapes at construction, the rest at the step.

MuonOptions::MuonOptions(double lr) : lr_(lr) {}

bool operator==(const MuonOptions& lhs, const MuonOptions& rhs) {
  return lhs.lr() == rhs.lr() && lhs.weight_decay() == rhs.weight_decay() && lhs.momentum() == rhs.momentum() &&
         lhs.nesterov() == rhs.nesterov() && lhs.ns_coefficients() == rhs.ns_coefficients() && lhs.eps() == rhs.eps() &&
         lhs.ns_steps() == rhs.ns_steps() && lhs.adjust_lr_fn() == rhs.adjust_lr_fn() && lhs.flatten() == rhs.flatten();
}

void MuonOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_coefficients);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(ns_steps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adjust_lr_fn);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(flatten);
}

void MuonOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  c10::IValue coefficients;
  if (archive.try_read("ns_coefficients", coefficients)) ns_coefficients(coefficients.toDoubleVector());
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, ns_steps);
  c10::IValue fn;
  if (archive.try_read("adjust_lr_fn", fn)) adjust_lr_fn(fn.toStringRef());
  c10::IValue flat;
  if (archive.try_read("flatten", flat)) flatten(flat.toBool());
}

bool operator==(const MuonParamState& lhs, const MuonParamState& rhs) {
  const at::Tensor &l = lhs.momentum_buffer(), &r = rhs.momentum_buffer();
  return l.defined() == r.defined() && (!l.defined() || at::equal(l, r));
}

void MuonParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
}

void MuonParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
}

namespace {

// Python's repr of a shape: "torch.Size([3, 4])".
std::string torch_size(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << "torch.Size([";
  for (size_t i = 0; i < sizes.size(); ++i) out << (i ? ", " : "") << sizes[i];
  out << "])";
  return out.str();
}

}  // namespace

Muon::Muon(const std::vector<torch::optim::OptimizerParamGroup>& param_groups, MuonOptions defaults)
    : Optimizer(param_groups, std::make_unique<MuonOptions>(defaults)) {
  TORCH_CHECK(defaults.lr() >= 0, "Learning rate should be >= 0 but is: ", defaults.lr());
  TORCH_CHECK(defaults.momentum() >= 0, "momentum should be >= 0 but is: ", defaults.momentum());
  TORCH_CHECK(defaults.weight_decay() >= 0, "weight decay should be >= 0 but is: ", defaults.weight_decay());
  TORCH_CHECK(defaults.adjust_lr_fn() == "original" || defaults.adjust_lr_fn() == "match_rms_adamw",
              "Adjust learning rate function ", defaults.adjust_lr_fn(), " is not supported");
  for (const auto& group : param_groups_) {
    const bool flatten = static_cast<const MuonOptions&>(group.options()).flatten();
    for (const auto& p : group.params()) {
      TORCH_CHECK(p.dim() == 2 || (flatten && p.dim() > 2),
                  "Muon only supports 2D parameters whereas we found a parameter with size: ", torch_size(p.sizes()),
                  flatten ? "" : " (MuonOptions().flatten(true) takes a parameter of more dimensions as a matrix)");
    }
  }
}

Muon::Muon(std::vector<at::Tensor> params, MuonOptions defaults)
    : Muon({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

double muon_adjusted_lr(double lr, const std::string& fn, at::IntArrayRef sizes) {
  TORCH_CHECK(sizes.size() >= 2, "Muon adjusts the learning rate of a matrix, got a parameter of size ",
              torch_size(sizes));
  const auto rows = static_cast<double>(sizes[0]);
  const auto cols = static_cast<double>(c10::multiply_integers(sizes.begin() + 1, sizes.end()));
  if (fn == "original") return lr * std::sqrt(std::max(1.0, rows / cols));
  if (fn == "match_rms_adamw") return lr * (0.2 * std::sqrt(std::max(rows, cols)));
  return lr;
}

at::Tensor muon_orthogonalize(const at::Tensor& update, const std::vector<double>& ns_coefficients,
                              int64_t ns_steps, double eps) {
  TORCH_CHECK(ns_steps < 100, "Number of steps must be less than 100 for computational efficiency");
  TORCH_CHECK(update.dim() == 2, "Input tensor gradient must be a 2D matrix");
  TORCH_CHECK(ns_coefficients.size() == 3, "Coefficients must be a tuple of exactly 3 values");
  const double a = ns_coefficients[0], b = ns_coefficients[1], c = ns_coefficients[2];
  const bool tall = update.size(0) > update.size(1);
  at::Tensor x = update.to(at::kBFloat16);
  if (tall) x = x.t();
  // The spectral norm at most 1.
  x.div_(at::clamp(at::linalg_vector_norm(x, 2), eps));
  for (int64_t k = 0; k < ns_steps; ++k) {
    const at::Tensor gram = at::matmul(x, x.t());
    const at::Tensor gram_update = at::addmm(gram, gram, gram, /*beta=*/b, /*alpha=*/c);
    x = at::addmm(x, gram_update, x, /*beta=*/a);
  }
  return tall ? x.t() : x;
}

at::Tensor Muon::step(LossClosure closure) {
  at::NoGradGuard no_grad;
  at::Tensor loss;
  if (closure) {
    at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  for (auto& group : param_groups_) {
    const auto& options = static_cast<const MuonOptions&>(group.options());
    // As PyTorch: the group's parameters with a gradient checked and given state first, then each
    // stepped.
    std::vector<std::pair<at::Tensor, MuonParamState*>> stepped;
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      TORCH_CHECK(!p.is_complex(), "Muon does not support complex parameters");
      TORCH_CHECK(!p.grad().is_sparse(), "Muon does not support sparse gradients");
      auto& state = state_[p.unsafeGetTensorImpl()];
      if (!state) {
        auto fresh = std::make_unique<MuonParamState>();
        fresh->momentum_buffer(at::zeros_like(p.grad(), at::MemoryFormat::Preserve));
        state = std::move(fresh);
      }
      stepped.emplace_back(p, static_cast<MuonParamState*>(state.get()));
    }
    for (auto& [p, state] : stepped) {
      const at::Tensor& grad = p.grad();
      TORCH_CHECK(grad.dim() == 2 || (options.flatten() && grad.dim() > 2), "Param gradient must be a 2D matrix");
      at::Tensor& buf = state->momentum_buffer();
      buf.lerp_(grad, 1 - options.momentum());
      at::Tensor update = options.nesterov() ? grad.lerp(buf, options.momentum()) : buf;
      if (update.dim() > 2) update = update.reshape({update.size(0), -1});
      update = muon_orthogonalize(update, options.ns_coefficients(), options.ns_steps(), options.eps());
      const double adjusted = muon_adjusted_lr(options.lr(), options.adjust_lr_fn(), p.sizes());
      p.mul_(1 - options.lr() * options.weight_decay());
      p.add_(update.view(p.sizes()), -adjusted);
    }
  }
  return loss;
}

// Note [Muon's cost]
// One Newton-Schulz iteration on an m x n matrix, s = min(m, n) and l = max(m, n), runs on the
// s x l orientation: X X^T (s*s*l multiply-adds), b A + c A A (s*s*s), and B X (s*s*l), so
// s^2 (2 l + s) per iteration, ns_steps times; the momentum update and the rest are O(m n). OSS
// balances the owners of whole matrices by this (the iteration count is the same for every matrix
// of a group, so it is left out): about m n min(m, n), not the matrix's bytes. Two matrices of the
// same bytes, 64 x 4096 and 512 x 512, cost 2 x 64^2 x 4096 + 64^3 = 3.4e7 and 3 x 512^3 = 4.0e8.
double muon_cost(at::IntArrayRef sizes) {
  if (sizes.size() < 2) return static_cast<double>(c10::multiply_integers(sizes));
  const int64_t rows = sizes[0], cols = c10::multiply_integers(sizes.begin() + 1, sizes.end());
  const double s = static_cast<double>(std::min(rows, cols));
  const double l = static_cast<double>(std::max(rows, cols));
  return s * s * (2 * l + s);
}

namespace detail {

void register_muon() {
  using Registration = OptimizerRegistration<Muon, MuonOptions, MuonParamState>;
  register_optimizer(
      Registration("Muon", StateKind::kWholeTensor)
          .option("lr", [](MuonOptions& o) -> double& { return o.lr(); })
          .option("weight_decay", [](MuonOptions& o) -> double& { return o.weight_decay(); })
          .option("momentum", [](MuonOptions& o) -> double& { return o.momentum(); })
          .option("nesterov", [](MuonOptions& o) -> bool& { return o.nesterov(); })
          .option(
              "ns_coefficients",
              [](const MuonOptions& o) {
                std::vector<c10::IValue> items(o.ns_coefficients().begin(), o.ns_coefficients().end());
                return c10::IValue(c10::ivalue::Tuple::create(std::move(items)));
              },
              [](MuonOptions& o, const c10::IValue& v) {
                TORCH_CHECK(v.isTuple() || v.isList(), "state_dict option 'ns_coefficients' must be a tuple, got ",
                            v.tagKind());
                std::vector<double> values;
                for (const auto& x : v.isTuple() ? v.toTupleRef().elements().vec() : v.toListRef().vec()) {
                  values.push_back(detail::option_value<double>("ns_coefficients", x));
                }
                o.ns_coefficients(values);
              })
          .option("eps", [](MuonOptions& o) -> double& { return o.eps(); })
          .option("ns_steps", [](MuonOptions& o) -> int64_t& { return o.ns_steps(); })
          // PyTorch's default is None, which means "original".
          .option(
              "adjust_lr_fn", [](const MuonOptions& o) { return c10::IValue(o.adjust_lr_fn()); },
              [](MuonOptions& o, const c10::IValue& v) {
                TORCH_CHECK(v.isNone() || v.isString(), "state_dict option 'adjust_lr_fn' must be None or a "
                            "string, got ", v.tagKind());
                o.adjust_lr_fn(v.isNone() ? "original" : v.toStringRef());
              })
          .option("flatten", [](MuonOptions& o) -> bool& { return o.flatten(); })
          .tensor("momentum_buffer", [](MuonParamState& s) -> at::Tensor& { return s.momentum_buffer(); })
          // Under StateFormat::kInt8 the momentum is coded like Adam's first moment (a signed EMA of
          // the gradients): the signed dynamic map, blocks of 256 of the whole matrix.
          .compressible("momentum_buffer", StateCodes::kSigned)
          .cost(&muon_cost));
}

}  // namespace detail

void Muon::save(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

void Muon::load(torch::serialize::InputArchive& archive) {
  torch::optim::serialize<MuonParamState, MuonOptions>(archive, *this);
}

}  // namespace shardopt
