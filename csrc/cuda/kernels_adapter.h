// The fused step on CUDA tensors: the kernels of kernels/ (a C ABI) fed from tensors. Internal to
// shardopt; csrc/optim/fused_step.cpp calls it for fp32 CUDA parameters.
#pragma once

#include "optim/fused_kernels.h"

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace shardopt::detail {

// Whether this build carries kernels/'s CUDA kernels (nvcc found and LibTorch built with CUDA).
bool cuda_kernels_built();

// One Adam/AdamW step of an fp32 CUDA parameter with its gradient and state (same device,
// contiguous), `step` counted from 1, on the device's current stream; `vmax` undefined without
// AMSGrad. The scalars are the CPU step's (AdamScalars), so both paths compute alike.
void cuda_adam(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               const at::Tensor& vmax, const AdamScalars& s, int64_t step);

// One SGD step of an fp32 CUDA parameter; `buf` undefined without momentum.
void cuda_sgd(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf, const SgdScalars& s);

}  // namespace shardopt::detail
