// The fused step as OSS calls it. New state goes where OSS says (its ShardStore's slabs). Writing
// low-precision copies: under mixed precision on CUDA, OSS hands the
// masters it steps to kernels/'s mixed Adam/AdamW step with their gradients as reduced (bf16, fp16
// or fp32) and the ranges of the parameters they update, so that the upcast gradient and the
// separate write-back pass never exist. Internal to shardopt.
#pragma once

#include <c10/core/TensorImpl.h>
#include <torch/csrc/api/include/torch/optim/optimizer.h>

#include <functional>
#include <string>
#include <unordered_map>

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

// fused_step_unsupported and fused_step (shardopt/optim/fused_step.h) with `copies`: each master in
// it must be an fp32 CUDA tensor stepped by the mixed kernel; new state from `allocate`.
std::string fused_step_unsupported(const torch::optim::Optimizer& optimizer, const LowPrecisionCopies& copies);
void fused_step(torch::optim::Optimizer& optimizer, const LowPrecisionCopies& copies, const StateAllocator& allocate);

}  // namespace shardopt::detail
