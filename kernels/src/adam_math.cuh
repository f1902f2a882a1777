// Adam's per-element math, shared by the fp32, mixed-precision and 8-bit-state steps
// (shardopt_kernels/adamw.h, adamw8.h): the step's scalars, the hyper-parameters' ranges and one
// element's update. Internal to kernels/src.
#pragma once

#include <shardopt_kernels/adamw.h>

#include <cuda_runtime.h>

#include <cmath>

namespace shardopt_kernels {

enum class WeightDecay : int { kNone, kCoupled, kDecoupled };

// The step's scalars in fp32, each computed in double first, as the CPU fused step computes them.
struct AdamScalars {
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float weight_decay;  // Adam:  g = fma(p, weight_decay, g)
  float decay;         // AdamW: p = p * decay, decay = 1 - lr * weight_decay
  float inv_sqrt_bias_correction2, eps, neg_step_size;
  WeightDecay mode;
};

inline AdamScalars scalars_of(const shardopt_adamw_hparams& h) {
  const double step = static_cast<double>(h.step);
  const double bias_correction1 = 1 - std::pow(h.beta1, step);
  const double bias_correction2 = 1 - std::pow(h.beta2, step);
  AdamScalars s;
  s.beta1 = static_cast<float>(h.beta1);
  s.one_minus_beta1 = static_cast<float>(1 - h.beta1);
  s.beta2 = static_cast<float>(h.beta2);
  s.one_minus_beta2 = static_cast<float>(1 - h.beta2);
  s.weight_decay = static_cast<float>(h.weight_decay);
  s.decay = static_cast<float>(1 - h.lr * h.weight_decay);
  s.inv_sqrt_bias_correction2 = static_cast<float>(1 / std::sqrt(bias_correction2));
  s.eps = static_cast<float>(h.eps);
  s.neg_step_size = static_cast<float>(-(h.lr / bias_correction1));
  s.mode = h.weight_decay == 0 ? WeightDecay::kNone : h.decoupled ? WeightDecay::kDecoupled : WeightDecay::kCoupled;
  return s;
}

// torch.optim's ranges; NaN fails every comparison, so it is refused too.
inline bool valid(const shardopt_adamw_hparams* h) {
  return h != nullptr && h->lr >= 0 && h->beta1 >= 0 && h->beta1 < 1 && h->beta2 >= 0 && h->beta2 < 1 &&
         h->eps >= 0 && h->weight_decay >= 0 && h->step >= 1 && std::isfinite(h->lr) && std::isfinite(h->eps) &&
         std::isfinite(h->weight_decay);
}

// max(a, b), NaN when either is NaN, as at::vec::maximum in the CPU step.
__device__ __forceinline__ float max_or_nan(float a, float b) {
  return (isnan(a) || isnan(b)) ? __int_as_float(0x7fc00000) : fmaxf(a, b);
}

// One element's update; g is already unscaled and signed. Each product and sum is rounded on its
// own (the __f*_rn intrinsics are never contracted into an fma) and each fma is explicit, in the
// CPU step's order (csrc/optim/fused_kernels.inc).
template <bool kAmsgrad>
__device__ __forceinline__ void adam_element(float& p, float g, float& m, float& v, float& v_max, const AdamScalars& s) {
  if (s.mode == WeightDecay::kDecoupled) {
    p = __fmul_rn(p, s.decay);
  } else if (s.mode == WeightDecay::kCoupled) {
    g = __fmaf_rn(p, s.weight_decay, g);
  }
  m = __fmaf_rn(g, s.one_minus_beta1, __fmul_rn(m, s.beta1));
  v = __fadd_rn(__fmul_rn(v, s.beta2), __fmul_rn(__fmul_rn(s.one_minus_beta2, g), g));
  float second_moment = v;
  if constexpr (kAmsgrad) {
    v_max = max_or_nan(v_max, v);
    second_moment = v_max;
  }
  const float denom = __fmaf_rn(__fsqrt_rn(second_moment), s.inv_sqrt_bias_correction2, s.eps);
  p = __fadd_rn(p, __fdiv_rn(__fmul_rn(s.neg_step_size, m), denom));
}

}  // namespace shardopt_kernels
