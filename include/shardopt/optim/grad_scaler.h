// ShardedGradScaler: loss scaling for fp16 training under OSS (and ShardedDDP), like
// torch::amp::GradScaler with the non-finite check sharded.
//
//   shardopt::ShardedGradScaler scaler;
//   scaler.scale(loss).backward();     // gradients reduced to their owners, scaled
//   scaler.unscale_(opt);              // optional: before clipping
//   opt.clip_grad_norm(1.0);           //   (clips the unscaled gradients)
//   scaler.step(opt);                  // skipped on every rank if any gradient was inf/nan
//   scaler.update();                   // backoff after a skip, growth after growth_interval good steps
//
// unscale_() divides every gradient this rank holds by the scale and checks the ones it owns
// for inf/nan (ATen's _amp_foreach_non_finite_check_and_unscale_: one pass); the found-inf flag
// is then agreed across every rank of the optimizer's global group (one 4-byte all-reduce), so
// the ranks skip the same steps and the optimizer state, master weights and parameters stay
// untouched in a skipped step. unscale_() and step() are collective; unscale_() twice for one
// optimizer before update() is an error, as in PyTorch.
//
// step() without unscale_() before it, on an OSS whose fused step takes the optimizer (Adam,
// AdamW, SGD: OSSOptions::fused_step), folds the unscale into the step as PyTorch's fused
// optimizers do: each rank checks the gradients it steps (read only), the ranks agree on the
// flag, and the step multiplies each gradient by 1/scale as it reads it, with the same result as
// unscaling first. The gradients stay scaled. On CUDA over NCCL the flag stays on the device and
// the kernels skip on it, so nothing waits for the host before the step (Note [Unscaling in the
// step] in fused_step.cpp). Any other optimizer is unscaled first, as by unscale_().
#pragma once

#include <shardopt/optim/oss.h>

#include <torch/arg.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <unordered_map>

namespace shardopt {

struct GradScalerOptions {
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // Off: scale() returns the loss unchanged and step() just steps.
  TORCH_ARG(bool, enabled) = true;
};

class ShardedGradScaler {
 public:
  explicit ShardedGradScaler(GradScalerOptions options = {});

  // loss * scale (in the loss's dtype).
  at::Tensor scale(const at::Tensor& loss) const;
  // Unscales this rank's gradients of `optimizer` and agrees on found-inf. Collective.
  void unscale_(OSS& optimizer);
  // Steps `optimizer` unless a non-finite gradient was found on any rank (unscaling first if
  // unscale_() was not called); returns whether it stepped. Collective.
  bool step(OSS& optimizer);
  // Backs the scale off if any step since the last update() found inf/nan, else counts a good
  // step and grows the scale after growth_interval of them in a row. Local (the flags are agreed).
  void update();

  double get_scale() const { return scale_; }
  int64_t growth_tracker() const { return growth_tracker_; }
  // Restores a scale and tracker saved with a checkpoint (TrainingState::scalars, say).
  void load(double scale, int64_t growth_tracker);
  const GradScalerOptions& options() const { return options_; }

 private:
  struct PerOptimizer {
    bool unscaled = false;
    bool found_inf = false;
  };
  GradScalerOptions options_;
  double scale_;
  int64_t growth_tracker_ = 0;
  std::unordered_map<const OSS*, PerOptimizer> per_optimizer_;
};

}  // namespace shardopt
