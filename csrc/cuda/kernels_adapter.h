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

// One operand set of the CUDA Adam/AdamW step: an fp32 parameter (or, under mixed precision, the
// fp32 master) `p` with its gradient `g` and state (same device, contiguous); `vmax` undefined
// without AMSGrad; `copy` the bf16/fp16 parameter copy under mixed precision (Note [Mixed
// precision]), written with the updated master rounded, else undefined.
struct CudaAdamOperands {
  at::Tensor p, g, m, v, vmax, copy;
};

// One Adam/AdamW step of every entry of `run` (same options, `step` counted from 1), on each
// device's current stream, in as few launches as kernels/ allows: one per device, dtype pair and
// SHARDOPT_ADAMW_SEGMENTS_PER_LAUNCH entries. The scalars are the CPU step's (AdamScalars), so
// both paths compute alike.
void cuda_adam(const std::vector<CudaAdamOperands>& run, const AdamScalars& s, int64_t step);

// One SGD step of an fp32 CUDA parameter; `buf` undefined without momentum.
void cuda_sgd(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf, const SgdScalars& s);

// The L2 norm squared (or, with `inf`, the largest magnitude) of every element of `tensors`, and
// whether any is inf or NaN, as a 2-element fp32 tensor on their device, with no host
// synchronisation: kernels/'s two-stage norm over the tensors' memory (adjacent tensors merged
// into one segment). Undefined when the kernel cannot take them: not all contiguous CUDA tensors of
// one device and one dtype among fp32, bf16 and fp16, or none at all.
at::Tensor cuda_norm(const std::vector<at::Tensor>& tensors, bool inf);

}  // namespace shardopt::detail
