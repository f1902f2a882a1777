// Tensors to kernels/'s C ABI: checked pointers, the current stream, the status turned into an
// error that names the kernel and the CUDA error.
#include "cuda/kernels_adapter.h"

#include <shardopt/check.h>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <ATen/ATen.h>
#include <shardopt_kernels/adamw.h>
#include <shardopt_kernels/norm.h>
#include <shardopt_kernels/sgd.h>

#include <algorithm>
#include <cstring>

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

bool kernel_dtype(at::ScalarType t, shardopt_kernel_dtype* out) {
  switch (t) {
    case at::kFloat: *out = SHARDOPT_KERNEL_FLOAT32; return true;
    case at::kBFloat16: *out = SHARDOPT_KERNEL_BFLOAT16; return true;
    case at::kHalf: *out = SHARDOPT_KERNEL_FLOAT16; return true;
    default: return false;
  }
}

shardopt_adamw_hparams adam_hparams(const AdamScalars& s, int64_t step) {
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
  return h;
}

cudaStream_t current_stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

}  // namespace

bool cuda_kernels_built() { return true; }

void cuda_adam(const std::vector<CudaAdamOperands>& run, const AdamScalars& s, int64_t step) {
  // The run's segments by device and by the copy's and gradient's dtypes (FLOAT32 copy: none).
  struct Launches {
    c10::Device device;
    shardopt_kernel_dtype copy, grad;
    std::vector<shardopt_adamw_segment> segments;
  };
  std::vector<Launches> launches;
  for (const CudaAdamOperands& e : run) {
    const at::Tensor& p = e.p;
    check_operand(p, p, e.copy.defined() ? "master weight" : "parameter");
    check_operand(e.m, p, "exp_avg");
    check_operand(e.v, p, "exp_avg_sq");
    if (s.amsgrad) check_operand(e.vmax, p, "max_exp_avg_sq");
    shardopt_kernel_dtype copy = SHARDOPT_KERNEL_FLOAT32, grad = SHARDOPT_KERNEL_FLOAT32;
    if (e.copy.defined()) {
      SHARDOPT_CHECK(kernel_dtype(e.copy.scalar_type(), &copy) && copy != SHARDOPT_KERNEL_FLOAT32 &&
                         e.copy.device() == p.device() && e.copy.is_contiguous() && e.copy.numel() == p.numel(),
                     "fused CUDA mixed-precision step: the parameter copy is not a contiguous bf16/fp16 tensor of ",
                     p.numel(), " elements on ", p.device());
      SHARDOPT_CHECK(kernel_dtype(e.g.scalar_type(), &grad) && (grad == copy || grad == SHARDOPT_KERNEL_FLOAT32) &&
                         e.g.device() == p.device() && e.g.is_contiguous() && e.g.numel() == p.numel(),
                     "fused CUDA mixed-precision step: the gradient is not a contiguous ", e.copy.scalar_type(),
                     " or fp32 tensor of ", p.numel(), " elements on ", p.device());
    } else {
      check_operand(e.g, p, "gradient");
    }
    auto it = std::find_if(launches.begin(), launches.end(), [&](const Launches& l) {
      return l.device == p.device() && l.copy == copy && l.grad == grad;
    });
    if (it == launches.end()) it = launches.insert(launches.end(), Launches{p.device(), copy, grad, {}});
    it->segments.push_back({e.copy.defined() ? e.copy.data_ptr() : p.data_ptr(), e.g.data_ptr(),
                            e.copy.defined() ? f32(p) : nullptr, f32(e.m), f32(e.v),
                            s.amsgrad ? f32(e.vmax) : nullptr, p.numel()});
  }
  const shardopt_adamw_hparams h = adam_hparams(s, step);
  for (const Launches& l : launches) {
    const c10::cuda::CUDAGuard guard(l.device);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(l.device.index()).stream();
    const auto count = static_cast<int64_t>(l.segments.size());
    if (l.copy == SHARDOPT_KERNEL_FLOAT32) {
      check_status(shardopt_adamw_fp32_segments(l.segments.data(), count, &h, s.device_inv_scale,
                                                s.device_found_inf, stream),
                   "shardopt_adamw_fp32_segments");
    } else {
      check_status(shardopt_adamw_mixed_segments(l.segments.data(), count, l.copy, l.grad, &h, s.device_inv_scale,
                                                 s.device_found_inf, stream),
                   "shardopt_adamw_mixed_segments");
    }
  }
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
  check_status(shardopt_sgd_fp32(f32(p), f32(g), f32(buf), p.numel(), &h, s.device_inv_scale, s.device_found_inf,
                                 c10::cuda::getCurrentCUDAStream(p.device().index()).stream()),
               "shardopt_sgd_fp32");
}

at::Tensor cuda_norm(const std::vector<at::Tensor>& tensors, bool inf) {
  if (tensors.empty()) return {};
  const at::Tensor& first = tensors.front();
  shardopt_kernel_dtype dtype{};
  if (!first.is_cuda() || !kernel_dtype(first.scalar_type(), &dtype)) return {};
  // Segments in order, a tensor that starts where the last one ends extending it (the owned
  // gradients of one bucket are adjacent).
  std::vector<shardopt_norm_segment> segments;
  const int64_t element = static_cast<int64_t>(first.element_size());
  for (const auto& t : tensors) {
    if (!t.is_cuda() || t.device() != first.device() || t.scalar_type() != first.scalar_type() || !t.is_contiguous()) {
      return {};
    }
    if (t.numel() == 0) continue;
    if (!segments.empty()) {
      auto& last = segments.back();
      if (static_cast<const char*>(last.data) + last.count * element == static_cast<const char*>(t.data_ptr())) {
        last.count += t.numel();
        continue;
      }
    }
    segments.push_back({t.data_ptr(), t.numel()});
  }
  const c10::cuda::CUDAGuard guard(first.device());
  const auto on_device = at::TensorOptions().device(first.device());
  at::Tensor out = at::zeros({2}, on_device.dtype(at::kFloat));
  if (segments.empty()) return out;
  const int64_t descriptor_bytes = static_cast<int64_t>(segments.size() * sizeof(shardopt_norm_segment));
  at::Tensor host = at::empty({descriptor_bytes}, at::TensorOptions().dtype(at::kByte).pinned_memory(true));
  std::memcpy(host.data_ptr(), segments.data(), static_cast<size_t>(descriptor_bytes));
  // non_blocking from pinned memory: the caching allocator keeps `host` until the copy has run.
  const at::Tensor descriptors = host.to(on_device.dtype(at::kByte), /*non_blocking=*/true);
  size_t workspace_bytes = 0;
  check_status(shardopt_norm_workspace_bytes(&workspace_bytes), "shardopt_norm_workspace_bytes");
  const at::Tensor workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, on_device.dtype(at::kByte));
  check_status(shardopt_norm(static_cast<const shardopt_norm_segment*>(descriptors.data_ptr()),
                             static_cast<int64_t>(segments.size()), dtype,
                             inf ? SHARDOPT_NORM_INF : SHARDOPT_NORM_L2_SQUARED, workspace.data_ptr(), workspace_bytes,
                             out.data_ptr<float>(), out.data_ptr<float>() + 1, current_stream(first)),
               "shardopt_norm");
  return out;
}

}  // namespace shardopt::detail
