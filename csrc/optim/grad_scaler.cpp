#include <shardopt/optim/grad_scaler.h>
#include <shardopt/check.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <cmath>

namespace shardopt {

ShardedGradScaler::ShardedGradScaler(GradScalerOptions options) : options_(options), scale_(options.init_scale()) {
  SHARDOPT_CHECK(options_.init_scale() > 0 && std::isfinite(options_.init_scale()),
                 "GradScalerOptions init_scale must be positive and finite, got ", options_.init_scale());
  SHARDOPT_CHECK(options_.growth_factor() > 1.0, "GradScalerOptions growth_factor must be > 1, got ",
                 options_.growth_factor());
  SHARDOPT_CHECK(options_.backoff_factor() > 0.0 && options_.backoff_factor() < 1.0,
                 "GradScalerOptions backoff_factor must be in (0, 1), got ", options_.backoff_factor());
  SHARDOPT_CHECK(options_.growth_interval() > 0, "GradScalerOptions growth_interval must be > 0, got ",
                 options_.growth_interval());
}

at::Tensor ShardedGradScaler::scale(const at::Tensor& loss) const {
  if (!options_.enabled()) return loss;
  return loss * scale_;
}

void ShardedGradScaler::unscale_(OSS& optimizer) {
  if (!options_.enabled()) return;
  SHARDOPT_CHECK(!optimizer.steps_in_backward(), "ShardedGradScaler::unscale_: the OSS steps in its ShardedDDP's backward "
                 "(ShardedDDPOptions::step_in_backward), with the gradients still scaled and before any could be "
                 "checked; turn step_in_backward off to use a gradient scaler");
  PerOptimizer& state = per_optimizer_[&optimizer];
  SHARDOPT_CHECK(!state.unscaled, "unscale_() was already called on this optimizer since the last update()");
  CommPhase phase("gradient scaler (unscale and found-inf check)");
  at::NoGradGuard no_grad;
  const at::Tensor inv_scale = at::full({}, 1.0 / scale_, at::kFloat);
  at::Tensor found = at::zeros({1}, at::kFloat);
  // Each gradient tensor this rank holds is unscaled once; the check covers all of them, so
  // every owned element is checked by its owner (and a non-owned one possibly by others too).
  std::vector<at::Tensor> held = optimizer.grads(/*owned_only=*/false);
  // ATen's kernel groups by device and dtype itself; one call per device keeps found_inf on it.
  std::unordered_map<std::string, std::vector<at::Tensor>> by_device;
  for (auto& g : held) by_device[g.device().str()].push_back(g);
  for (auto& [device, list] : by_device) {
    at::Tensor found_here = at::zeros({1}, list.front().options().dtype(at::kFloat));
    at::_amp_foreach_non_finite_check_and_unscale_(list, found_here, inv_scale.to(found_here.device()));
    found.add_(found_here.to(at::kCPU));
  }
  ProcessGroup& group = optimizer.global_group();
  if (group.size() > 1) group.allreduce(found, Reduction::kMax);
  state.unscaled = true;
  state.found_inf = found.item<float>() > 0;
}

bool ShardedGradScaler::step(OSS& optimizer) {
  if (!options_.enabled()) {
    optimizer.step();
    return true;
  }
  SHARDOPT_CHECK(!optimizer.steps_in_backward(), "ShardedGradScaler::step: the OSS steps in its ShardedDDP's backward "
                 "(ShardedDDPOptions::step_in_backward), with the gradients still scaled and before any could be "
                 "checked; turn step_in_backward off to use a gradient scaler");
  PerOptimizer& state = per_optimizer_[&optimizer];
  if (!state.unscaled && optimizer.can_unscale_in_step()) {
    state.unscaled = true;  // by the step: an unscale_() before update() is an error
    state.found_inf = !optimizer.step_unscaling(1.0 / scale_);
    return !state.found_inf;
  }
  if (!state.unscaled) unscale_(optimizer);
  if (state.found_inf) return false;
  optimizer.step();
  return true;
}

void ShardedGradScaler::update() {
  if (!options_.enabled()) return;
  bool found_inf = false;
  for (const auto& [opt, state] : per_optimizer_) found_inf |= state.found_inf;
  if (found_inf) {
    scale_ *= options_.backoff_factor();
    growth_tracker_ = 0;
  } else if (++growth_tracker_ == options_.growth_interval()) {
    scale_ *= options_.growth_factor();
    growth_tracker_ = 0;
  }
  per_optimizer_.clear();
}

void ShardedGradScaler::load(double scale, int64_t growth_tracker) {
  SHARDOPT_CHECK(scale > 0 && std::isfinite(scale), "ShardedGradScaler::load: scale must be positive and finite, got ",
                 scale);
  SHARDOPT_CHECK(growth_tracker >= 0, "ShardedGradScaler::load: growth_tracker must be >= 0, got ", growth_tracker);
  scale_ = scale;
  growth_tracker_ = growth_tracker;
}

}  // namespace shardopt
