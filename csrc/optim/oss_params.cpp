// OSS's parameters and gradients around the step: the parameter sync after it (Note [Parameter
// sync], overlapped or not), clearing and clipping the gradients this rank holds, and mixed
// precision's master weights.
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>

#include "cuda/kernels_adapter.h"
#include "optim/master_weights.h"
#include "optim/param_buffers.h"
#include "optim/shard_store.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cmath>

namespace shardopt {

// ---- the parameter sync (the store's: Note [Overlapped parameter sync]) ----------------------

void OSS::finish_param_sync() { store_->finish_param_sync(); }

void OSS::finish_param_sync(size_t param) { store_->finish_param_sync(param); }


void OSS::zero_grad(bool set_to_none) {
  store_->forget_zeroed();
  if (set_to_none) {
    for (auto& p : params_) p.mutable_grad() = at::Tensor();
    store_->clear_grads();
    return;
  }
  // Zeroed in place, noted for ShardedDDP (Note [Gradients as bucket views]).
  auto zero = [this](at::Tensor& g) {
    g.detach_();
    g.zero_();
    store_->note_zeroed(g);
  };
  for (auto& p : params_) {
    if (p.grad().defined()) zero(p.mutable_grad());
  }
  store_->for_each_grad(zero);
}

std::vector<at::Tensor> OSS::grads(bool owned_only) const {
  // A rank that owns a range counts it (owned_only); every gradient this rank holds is listed
  // otherwise, not only the owned ones: a step that lays the buffers out for a new trainable
  // set may hand a range to a rank that did not own it at the time of a clip.
  std::vector<at::Tensor> out;
  for (size_t i = 0; i < params_.size(); ++i) {
    // The flags as they are now, not as of the last step(): unfreezing takes effect at once.
    if (!params_[i].requires_grad()) continue;
    const bool full = params_[i].grad().defined();
    if (full && !owned_only) out.push_back(params_[i].grad());
    for (const auto& h : holdings_[i]) {
      if (h.rank != group_->rank() || (full && !owned_only)) continue;
      at::Tensor g = holding_grad(i, h);
      if (g.defined()) out.push_back(g);
    }
  }
  return out;
}

double OSS::clip_grad_norm(double max_norm, double norm_type, bool error_if_nonfinite) {
  SHARDOPT_CHECK(!steps_in_backward(), "clip_grad_norm: this OSS stepped in its ShardedDDP's backward "
                 "(ShardedDDPOptions::step_in_backward), before the gradients could be clipped; turn step_in_backward "
                 "off to clip");
  SHARDOPT_CHECK(max_norm >= 0, "clip_grad_norm max_norm must be >= 0, got ", max_norm);
  SHARDOPT_CHECK(norm_type > 0, "clip_grad_norm norm_type must be > 0 (or inf), got ", norm_type);
  const bool inf = std::isinf(norm_type);
  const std::vector<at::Tensor> owned = grads(/*owned_only=*/true), held = grads(/*owned_only=*/false);
  // Each norm in double (low-precision gradients lose nothing to the sum), all of them combined
  // where they are, and one copy to the host: one synchronisation per clip on a GPU, not one per
  // tensor.
  // On CUDA, the L2 and inf norms of gradients of one dtype are kernels/'s two-stage norm over
  // their memory (two launches, whatever the number of tensors).
  const at::Tensor fused = norm_type == 2 || inf ? detail::cuda_norm(owned, inf) : at::Tensor();
  std::vector<at::Tensor> norms;
  for (const auto& g : fused.defined() ? std::vector<at::Tensor>{} : owned) {
    at::Tensor n = at::linalg_vector_norm(g, norm_type, c10::nullopt, false, at::kDouble);
    norms.push_back(norms.empty() ? n : n.to(norms.front().device()));
  }
  at::Tensor t = at::zeros({1}, at::kDouble);
  if (fused.defined()) {
    // {value, found non-finite}: a NaN leaves the inf norm's value finite, and must show.
    const at::Tensor both = fused.to(at::kCPU, at::kDouble);
    const double value = both[0].item<double>();
    t.fill_(both[1].item<double>() != 0 && std::isfinite(value) ? std::nan("") : value);
  } else if (!norms.empty()) {
    const at::Tensor all = at::stack(norms);
    t = (inf ? all.max() : all.pow(norm_type).sum()).reshape({1}).to(at::kCPU);
  }
  group_->allreduce(t, inf ? Reduction::kMax : Reduction::kSum);
  const double total = inf ? t.item<double>() : std::pow(t.item<double>(), 1.0 / norm_type);
  // (Every rank holds the same total after the all-reduce: every rank refuses alike.)
  SHARDOPT_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm: the total norm of order ", norm_type,
                 " of the gradients is non-finite (", total, "), so it cannot be clipped; leave error_if_nonfinite "
                 "false to clip anyway (the gradients then become NaN)");
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    at::NoGradGuard no_grad;
    for (const auto& g : held) g.mul_(coef);
  }
  return total;
}

// ---- master weights ---------------------------------------------------------------------------

void OSS::refresh_master_weights() {
  if (!masters_) return;
  finish_param_sync();
  for (size_t i = 0; i < params_.size(); ++i) {
    for (const auto& h : holdings_[i]) {
      if (h.rank == group_->rank()) detail::set_master(h.tensor, params_[i], h.in_param);
    }
  }
}

int64_t OSS::local_master_bytes() const {
  int64_t bytes = 0;
  for (const auto& list : holdings_) {
    for (const auto& h : list) {
      if (masters_ && h.rank == group_->rank()) bytes += static_cast<int64_t>(h.tensor.nbytes());
    }
  }
  return bytes;
}

}  // namespace shardopt
