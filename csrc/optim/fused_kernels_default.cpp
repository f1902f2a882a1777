// The fused step's loops for any x86-64 CPU.
#define SHARDOPT_KERNELS_NS kernels_default
#include "optim/fused_kernels.inc"

#include <shardopt/check.h>
#include <shardopt/comm/launch_env.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace shardopt::detail {

namespace {

// SHARDOPT_FUSED_KERNELS=default|avx2|avx512 caps the build used (to compare the others), read
// once.
std::atomic<int> kernel_cap{-1};

int cap_from_env() {
  const char* v = env_var("SHARDOPT_FUSED_KERNELS");
  if (!v) return 3;
  if (std::strcmp(v, "default") == 0) return 0;
  if (std::strcmp(v, "avx2") == 0) return 1;
  if (std::strcmp(v, "avx512") == 0) return 2;
  SHARDOPT_CHECK(std::strcmp(v, "avx512vbmi") == 0, "SHARDOPT_FUSED_KERNELS='", v,
                 "' is not one of default, avx2, avx512, avx512vbmi (the widest build of the fused step's loops to use)");
  return 3;
}

}  // namespace

void cap_cpu_kernels(int level) {
  kernel_cap.store(level < 0 ? cap_from_env() : std::min(level, 3));
}

int cpu_kernel_level() {
  int cap = kernel_cap.load(std::memory_order_relaxed);
  if (cap < 0) {
    cap = cap_from_env();
    kernel_cap.store(cap);
  }
#if defined(__x86_64__)
  static const int level = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                               ? (__builtin_cpu_supports("avx512vbmi") ? 3 : 2)
                               : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0);
  return std::min(level, cap);
#else
  return 0;
#endif
}

}  // namespace shardopt::detail
