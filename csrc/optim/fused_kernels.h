// The fused step's math over one contiguous tensor, built three times: for any x86-64 CPU, for
// AVX2 + FMA and for AVX-512 (chosen at run time, as ATen chooses its own kernels). Internal to
// csrc/optim.
#pragma once

#include <cstdint>
#include <functional>

namespace shardopt::detail {

// The per-step constants of one Adam/AdamW parameter.
struct AdamScalars {
  double lr = 0, beta1 = 0, beta2 = 0, eps = 0, weight_decay = 0;
  bool decoupled = false;  // AdamW: p *= 1 - lr * wd before the update; Adam: g += wd * p
  bool amsgrad = false;
  double sqrt_bias_correction2 = 1, step_size = 0;
};

struct SgdScalars {
  double lr = 0, momentum = 0, dampening = 0, weight_decay = 0;
  bool nesterov = false;
  bool first = false;  // the momentum buffer starts as the (decayed) gradient
};

// One set per instruction set; `vmax` may be null without AMSGrad, `buf` without momentum.
#define SHARDOPT_FUSED_KERNELS(ns)                                                                              \
  namespace ns {                                                                                                \
  void adam(float* p, const float* g, float* m, float* v, float* vmax, int64_t n, const AdamScalars& s);        \
  void adam(double* p, const double* g, double* m, double* v, double* vmax, int64_t n, const AdamScalars& s);   \
  void sgd(float* p, const float* g, float* buf, int64_t n, const SgdScalars& s);                               \
  void sgd(double* p, const double* g, double* buf, int64_t n, const SgdScalars& s);                            \
  }
SHARDOPT_FUSED_KERNELS(kernels_default)
SHARDOPT_FUSED_KERNELS(kernels_avx2)
SHARDOPT_FUSED_KERNELS(kernels_avx512)
#undef SHARDOPT_FUSED_KERNELS

// Runs body(begin, end) over [0, n) in up to at::get_num_threads() ranges of at least `grain`
// elements, on LibTorch's intra-op threads (Note [The fused step's threads] in fused_step.cpp),
// and waits for all.
void parallel_ranges(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body);

// The widest build this CPU runs: 2 for AVX-512 (F, BW, VL, DQ), 1 for AVX2 + FMA, 0 otherwise;
// the environment variable SHARDOPT_FUSED_KERNELS=default|avx2 caps it.
int cpu_kernel_level();

}  // namespace shardopt::detail
