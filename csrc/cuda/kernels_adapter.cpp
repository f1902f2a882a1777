// Tensors to kernels/'s C ABI: checked pointers, the current stream, the status turned into an
// error that names the kernel and the CUDA error.
#include "cuda/kernels_adapter.h"

#include <shardopt/check.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <shardopt_kernels/adamw.h>
#include <shardopt_kernels/sgd.h>

namespace shardopt::detail {

namespace {

float* f32(const at::Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; }

void check_operand(const at::Tensor& t, const at::Tensor& p, const char* what) {
  SHARDOPT_CHECK(t.device() == p.device() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                     t.numel() == p.numel(),
                 "fused CUDA step: the ", what, " is not a contiguous fp32 tensor of ", p.numel(), " elements on ",
                 p.device());
}

void check_status(shardopt_kernel_status status, const char* kernel) {
  if (status == SHARDOPT_KERNEL_OK) return;
  const std::string cuda = status == SHARDOPT_KERNEL_CUDA_ERROR
                               ? std::string(": ") + cudaGetErrorString(static_cast<cudaError_t>(shardopt_kernel_last_cuda_error()))
                               : std::string();
  SHARDOPT_CHECK(false, kernel, " failed: ", shardopt_kernel_status_string(status), cuda);
}

}  // namespace

bool cuda_kernels_built() { return true; }

void cuda_adam(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               const at::Tensor& vmax, const AdamScalars& s, int64_t step) {
  check_operand(p, p, "parameter");
  check_operand(g, p, "gradient");
  check_operand(m, p, "exp_avg");
  check_operand(v, p, "exp_avg_sq");
  if (s.amsgrad) check_operand(vmax, p, "max_exp_avg_sq");
  const c10::cuda::CUDAGuard guard(p.device());
  shardopt_adamw_hparams h{};
  h.lr = s.lr;
  h.beta1 = s.beta1;
  h.beta2 = s.beta2;
  h.eps = s.eps;
  h.weight_decay = s.weight_decay;
  h.step = step;
  h.decoupled = s.decoupled ? 1 : 0;
  h.amsgrad = s.amsgrad ? 1 : 0;
  h.maximize = 0;
  check_status(shardopt_adamw_fp32(f32(p), f32(g), f32(m), f32(v), s.amsgrad ? f32(vmax) : nullptr, p.numel(), &h,
                                   nullptr, nullptr, c10::cuda::getCurrentCUDAStream(p.device().index()).stream()),
               "shardopt_adamw_fp32");
}

void cuda_sgd(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf, const SgdScalars& s) {
  check_operand(p, p, "parameter");
  check_operand(g, p, "gradient");
  if (buf.defined()) check_operand(buf, p, "momentum buffer");
  const c10::cuda::CUDAGuard guard(p.device());
  shardopt_sgd_hparams h{};
  h.lr = s.lr;
  h.momentum = s.momentum;
  h.dampening = s.dampening;
  h.weight_decay = s.weight_decay;
  h.nesterov = s.nesterov ? 1 : 0;
  h.maximize = 0;
  h.first_step = s.first ? 1 : 0;
  check_status(shardopt_sgd_fp32(f32(p), f32(g), f32(buf), p.numel(), &h, nullptr, nullptr,
                                 c10::cuda::getCurrentCUDAStream(p.device().index()).stream()),
               "shardopt_sgd_fp32");
}

}  // namespace shardopt::detail
