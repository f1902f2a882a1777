// The fused step on CUDA tensors: the kernels of kernels/ (a C ABI) fed from tensors. Internal to
// shardopt; csrc/optim/fused_step.cpp calls it for fp32 CUDA parameters.
#pragma once

#include "optim/fused_kernels.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

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

// The mixed-precision Adam/AdamW step (Note [Mixed precision]): the fp32 `master` and its state
// take the update from `g` (the copy's dtype or fp32), and `copy` (bf16 or fp16, as many elements,
// contiguous) becomes the updated master rounded, in the same pass.
void cuda_adam_mixed(const at::Tensor& copy, const at::Tensor& g, const at::Tensor& master, const at::Tensor& m,
                     const at::Tensor& v, const at::Tensor& vmax, const AdamScalars& s, int64_t step);

// The L2 norm squared (or, with `inf`, the largest magnitude) of every element of `tensors`, and
// whether any is inf or NaN, as a 2-element fp32 tensor on their device, with no host
// synchronisation: kernels/'s two-stage norm over the tensors' memory (adjacent tensors merged
// into one segment). Undefined when the kernel cannot take them: not all contiguous CUDA tensors of
// one device and one dtype among fp32, bf16 and fp16, or none at all.
at::Tensor cuda_norm(const std::vector<at::Tensor>& tensors, bool inf);

}  // namespace shardopt::detail
