// The fused step as OSS calls it: each stepped tensor's gradient given beside it (no .grad is
// read), new state where OSS says (its ShardStore's slabs). Writing
// low-precision copies: under mixed precision on CUDA, OSS hands the
// masters it steps to kernels/'s mixed Adam/AdamW step with their gradients as reduced (bf16, fp16
// or fp32) and the ranges of the parameters they update, so that the upcast gradient and the
// separate write-back pass never exist. Internal to shardopt.
#pragma once

#include <c10/core/TensorImpl.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace shardopt::detail {

// Master weight (its TensorImpl) -> the contiguous bf16/fp16 range of the parameter it updates.
// Such a master's gradient may be in the copy's dtype or fp32.
using LowPrecisionCopies = std::unordered_map<const c10::TensorImpl*, at::Tensor>;

// Whether `optimizer` is torch::optim::Adam or AdamW (the optimizers with a mixed kernel).
bool adam_like(const torch::optim::Optimizer& optimizer);

// Where the fused step puts a state tensor it creates: a zeroed tensor shaped like `param` (the
// tensor the optimizer steps) for the state entry `kind` ("exp_avg", "momentum_buffer", ...), or
// undefined for a new tensor of its own. OSS gives the tensor's slot in its ShardStore.
using StateAllocator = std::function<at::Tensor(const at::Tensor& param, const char* kind)>;

// The fp32 block scales of a state tensor held as 8-bit codes (Note [8-bit state slabs] in
// state_slabs.cpp): one per kStateBlock elements from its start; undefined when it has none.
using StateScales = std::function<at::Tensor(const at::Tensor& codes)>;

// Stepped tensor (its TensorImpl) -> the gradient it steps with.
using Gradients = std::unordered_map<const c10::TensorImpl*, at::Tensor>;

// What OSS gives the fused step beside the optimizer.
struct FusedStepInputs {
  // The gradients: a tensor not in it is not stepped (its own .grad is not read).
  Gradients grads;
  // Each master in it must be an fp32 CUDA tensor stepped by the mixed kernel.
  LowPrecisionCopies copies;
  StateAllocator allocate;  // where new state goes (null: tensors of its own)
  StateScales scales;       // the scales of 8-bit state (null: there is none)
  // The gradient scaler's unscale folded into the step (Note [Unscaling in the step] in
  // fused_step.cpp): one-element fp32 tensors on the stepped tensors' device, or undefined.
  at::Tensor inv_scale;
  at::Tensor found_inf;  // nonzero: the step is skipped
};

// 1 (a one-element fp32 tensor on `device`) when any element of `tensors` is inf or NaN, else 0:
// read only, with no host synchronisation (kernels/'s norm on CUDA, ATen's multi-tensor inf norm
// elsewhere).
at::Tensor found_non_finite(const std::vector<at::Tensor>& tensors, at::Device device);

// What a fused step did: whether it stepped (false: found_inf skipped it, nothing changed), and the
// segments it stepped (Note [Adjacent tensors in one pass]); on CUDA, 32 of a run share a launch.
struct FusedStepResult {
  bool stepped = true;
  int64_t segments = 0;
};

// fused_step_unsupported and fused_step (shardopt/optim/fused_step.h) with OSS's inputs.
std::string fused_step_unsupported(const torch::optim::Optimizer& optimizer, const FusedStepInputs& in);
FusedStepResult fused_step(torch::optim::Optimizer& optimizer, const FusedStepInputs& in);

}  // namespace shardopt::detail
