// The fused SGD step (shardopt_kernels/sgd.h): a checked host entry, one kernel template over the
// buffers' element types, and the per-element math apart from the loads and stores.
#include <shardopt_kernels/sgd.h>

#include "common.cuh"

#include <cmath>

namespace shardopt_kernels {
namespace {

// The step's scalars in fp32, each computed in double first, as the CPU fused step computes them.
struct SgdScalars {
  float weight_decay, momentum;
  float keep;    // 1 - dampening
  float neg_lr;  // -lr
  bool has_weight_decay, nesterov, first_step;
};

SgdScalars scalars_of(const shardopt_sgd_hparams& h) {
  SgdScalars s;
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.momentum = static_cast<float>(h.momentum);
  s.keep = static_cast<float>(1 - h.dampening);
  s.neg_lr = static_cast<float>(-h.lr);
  s.has_weight_decay = h.weight_decay != 0;
  s.nesterov = h.nesterov != 0;
  s.first_step = h.first_step != 0;
  return s;
}

// torch.optim's ranges; NaN fails every comparison, so it is refused too.
bool valid(const shardopt_sgd_hparams* h) {
  return h != nullptr && h->lr >= 0 && h->momentum >= 0 && h->weight_decay >= 0 && std::isfinite(h->lr) &&
         std::isfinite(h->momentum) && std::isfinite(h->dampening) && std::isfinite(h->weight_decay) &&
         (!h->nesterov || (h->momentum > 0 && h->dampening == 0));
}

// One element's update; g is already unscaled and signed. Each product is rounded on its own and
// each fma is explicit, in the CPU step's order (csrc/optim/fused_kernels.inc).
template <bool kMomentum>
__device__ __forceinline__ void sgd_element(float& p, float g, float& buf, const SgdScalars& s) {
  float d = s.has_weight_decay ? __fmaf_rn(p, s.weight_decay, g) : g;
  if constexpr (kMomentum) {
    buf = s.first_step ? d : __fmaf_rn(d, s.keep, __fmul_rn(buf, s.momentum));
    d = s.nesterov ? __fmaf_rn(buf, s.momentum, d) : buf;
  }
  p = __fmaf_rn(d, s.neg_lr, p);
}

// The buffers of one segment. CopyT is void in the fp32 step (there the master is the parameter).
template <class GradT, class CopyT>
struct SgdBuffers {
  float* master;
  const GradT* grad;
  float* momentum_buf;
  CopyT* copy;
};

// Loads the Width elements at i, updates them, stores them. The first step writes the momentum
// buffer without reading it.
template <int Width, bool kMomentum, class GradT, class CopyT>
__device__ __forceinline__ void sgd_pack(const SgdBuffers<GradT, CopyT>& b, int64_t i, float grad_factor,
                                         const SgdScalars& s) {
  Pack<float, Width> p = load<Width>(b.master + i);
  const Pack<GradT, Width> g = load_readonly<Width>(b.grad + i);
  Pack<float, Width> buf{};
  if constexpr (kMomentum) {
    if (!s.first_step) buf = load<Width>(b.momentum_buf + i);
  }
#pragma unroll
  for (int k = 0; k < Width; ++k) {
    sgd_element<kMomentum>(p.v[k], __fmul_rn(to_float(g.v[k]), grad_factor), buf.v[k], s);
  }
  store<Width>(b.master + i, p);
  if constexpr (kMomentum) store<Width>(b.momentum_buf + i, buf);
  if constexpr (!std::is_void_v<CopyT>) store<Width>(b.copy + i, round_pack<CopyT>(p));
}

// sign is -1 to maximize, 1 otherwise; it and *inv_scale fold into one exact factor of the gradient.
template <int Width, bool kMomentum, class GradT, class CopyT>
__global__ void __launch_bounds__(kThreads)
    sgd_kernel(SgdBuffers<GradT, CopyT> b, int64_t n, Split split, SgdScalars s, float sign,
               const float* __restrict__ inv_scale, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const float grad_factor = inv_scale != nullptr ? __fmul_rn(sign, *inv_scale) : sign;
  for_each_pack<Width>(n, split, [&](auto width, int64_t i) {
    sgd_pack<decltype(width)::value, kMomentum>(b, i, grad_factor, s);
  });
}

template <class GradT, class CopyT>
shardopt_kernel_status launch(const SgdBuffers<GradT, CopyT>& b, int64_t n, const shardopt_sgd_hparams& h,
                              const float* inv_scale, const float* found_inf, cudaStream_t stream) {
  using Copy = std::conditional_t<std::is_void_v<CopyT>, float, CopyT>;
  constexpr int kWidth = kVectorBytes / static_cast<int>(std::min(sizeof(GradT), sizeof(Copy)));
  const Split split = split_for_vectors(
      n, kWidth, {{b.master, 4}, {b.grad, sizeof(GradT)}, {b.momentum_buf, 4}, {b.copy, sizeof(Copy)}});
  auto* kernel = b.momentum_buf != nullptr ? sgd_kernel<kWidth, true, GradT, CopyT> : sgd_kernel<kWidth, false, GradT, CopyT>;
  int blocks = 0;
  SHARDOPT_CUDA_TRY(blocks_for(kernel, std::max(split.vectors, n - split.vectors * kWidth), &blocks));
  kernel<<<blocks, kThreads, 0, stream>>>(b, n, split, scalars_of(h), h.maximize ? -1.0f : 1.0f, inv_scale,
                                          found_inf);
  SHARDOPT_CUDA_TRY(cudaGetLastError());
  return SHARDOPT_KERNEL_OK;
}

// The checks both entry points share once the element types are known.
template <class GradT, class CopyT>
shardopt_kernel_status checked_launch(const SgdBuffers<GradT, CopyT>& b, int64_t n, const shardopt_sgd_hparams& h,
                                      const float* inv_scale, const float* found_inf, cudaStream_t stream) {
  using Copy = std::conditional_t<std::is_void_v<CopyT>, float, CopyT>;
  const bool usable_buffers = usable(b.master, 4) && usable(b.grad, sizeof(GradT)) &&
                              (h.momentum == 0 || usable(b.momentum_buf, 4)) &&
                              (std::is_void_v<CopyT> || usable(b.copy, sizeof(Copy))) &&
                              usable_if_given(inv_scale, 4) && usable_if_given(found_inf, 4);
  if (!usable_buffers ||
      !disjoint({bytes_of(b.master, n, 4), bytes_of(b.grad, n, sizeof(GradT)), bytes_of(b.momentum_buf, n, 4),
                 bytes_of(b.copy, n, sizeof(Copy)), bytes_of(inv_scale, 1, 4), bytes_of(found_inf, 1, 4)})) {
    return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  }
  return launch(b, n, h, inv_scale, found_inf, stream);
}

}  // namespace
}  // namespace shardopt_kernels

using namespace shardopt_kernels;

extern "C" shardopt_kernel_status shardopt_sgd_fp32(float* param, const float* grad, float* momentum_buf, int64_t n,
                                                    const shardopt_sgd_hparams* hparams, const float* inv_scale,
                                                    const float* found_inf, cudaStream_t stream) {
  if (!valid(hparams) || n < 0) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  if (n == 0) return SHARDOPT_KERNEL_OK;
  const SgdBuffers<float, void> buffers{param, grad, hparams->momentum != 0 ? momentum_buf : nullptr, nullptr};
  return checked_launch(buffers, n, *hparams, inv_scale, found_inf, stream);
}

extern "C" shardopt_kernel_status shardopt_sgd_mixed(void* param, shardopt_kernel_dtype param_dtype, const void* grad,
                                                     shardopt_kernel_dtype grad_dtype, float* master,
                                                     float* momentum_buf, int64_t n,
                                                     const shardopt_sgd_hparams* hparams, const float* inv_scale,
                                                     const float* found_inf, cudaStream_t stream) {
  if (!valid(hparams) || n < 0) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  return dispatch_mixed(param_dtype, grad_dtype, [&](auto copy_tag, auto grad_tag) {
    using CopyT = typename decltype(copy_tag)::type;
    using GradT = typename decltype(grad_tag)::type;
    if (n == 0) return SHARDOPT_KERNEL_OK;
    const SgdBuffers<GradT, CopyT> buffers{master, static_cast<const GradT*>(grad),
                                           hparams->momentum != 0 ? momentum_buf : nullptr, static_cast<CopyT*>(param)};
    return checked_launch(buffers, n, *hparams, inv_scale, found_inf, stream);
  });
}
