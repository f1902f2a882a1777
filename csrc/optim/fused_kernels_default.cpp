// The fused step's loops for any x86-64 CPU.
#define SHARDOPT_KERNELS_NS kernels_default
#include "optim/fused_kernels.inc"

#include <cstdlib>
#include <cstring>

namespace shardopt::detail {

int cpu_kernel_level() {
  // SHARDOPT_FUSED_KERNELS=default|avx2 caps the build used (to test or compare the others).
  int cap = 2;
  if (const char* v = std::getenv("SHARDOPT_FUSED_KERNELS")) cap = std::strcmp(v, "default") == 0 ? 0 : (std::strcmp(v, "avx2") == 0 ? 1 : 2);
#if defined(__x86_64__)
  static const int level = (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
                               ? 2
                               : (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0);
  return std::min(level, cap);
#else
  return 0;
#endif
}

}  // namespace shardopt::detail
