// Mixed precision under OSS and ShardedDDP: low-precision parameters and gradients for forward
// and backward, fp32 master weights and optimizer state only on each range's owner.
//
//   shardopt::OSS opt(model->parameters(), shardopt::optimizer<torch::optim::AdamW>(...), group,
//                     shardopt::OSSOptions().mixed_precision(
//                         shardopt::MixedPrecision().param_dtype(torch::kBFloat16)));
//
// What OSS does with it (Note [Mixed precision] in csrc/optim/master_weights.cpp):
//   - at construction every parameter (fp32 usually; any floating dtype) takes global rank 0's
//     values, and each rank keeps an fp32 copy (the master weight) of the ranges it owns; then
//     the parameters become
//     param_dtype: the module's forward and backward run in it. Inputs must be param_dtype too
//     (ShardedDDP::forward casts floating-point tensor arguments).
//   - the wrapped optimizer steps the masters, so its state is fp32 and exists only for owned
//     ranges: 12 bytes per owned parameter for Adam (master, exp_avg, exp_avg_sq) against 2 per
//     parameter for the low-precision copy.
//   - on CUDA, Adam and AdamW with the fused step read the gradient as reduced and write the
//     rounded master into the parameter's range in the same pass (kernels/'s mixed step);
//     otherwise the owned gradient is upcast to fp32 for the step and the owner writes the
//     rounded master into its range of the parameters after it. The sync moves param_dtype bytes.
//   - ShardedDDP reduces gradients in reduce_dtype (default: param_dtype, ZeRO's 2 bytes per
//     gradient; kFloat32 upcasts each gradient into an fp32 bucket before the reduction).
//   - state_dict(), state_shard() and checkpoints carry the masters ("master_weights", by
//     parameter index, beside "state": torch.optim ignores the key); loading a state without
//     them starts the masters from the parameters.
// Parameters changed behind OSS's back (a module load without the optimizer's state) need
// OSS::refresh_master_weights(), which starts the masters from the parameters again.
#pragma once

#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <optional>
#include <string>

namespace shardopt {

struct MixedPrecision {
  bool enabled() const { return param_dtype_.has_value(); }
  c10::ScalarType reduce_or_param_dtype() const { return reduce_dtype_.value_or(*param_dtype_); }
  // Empty when the options are usable; otherwise what is wrong, naming the option.
  std::string problem() const;

  // The dtype of parameters and gradients in forward and backward: kBFloat16 or kHalf. Unset:
  // mixed precision off (everything in the parameters' own dtype).
  TORCH_ARG(std::optional<c10::ScalarType>, param_dtype) = std::nullopt;
  // The dtype gradients are reduced in: kFloat32 or param_dtype. Unset: param_dtype.
  TORCH_ARG(std::optional<c10::ScalarType>, reduce_dtype) = std::nullopt;
};

}  // namespace shardopt
