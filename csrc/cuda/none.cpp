// A build without kernels/'s CUDA kernels (no nvcc, or LibTorch without CUDA): the fused step
// keeps CUDA parameters on the wrapped optimizer's own step (fused_step_unsupported says so).
#include "cuda/kernels_adapter.h"

#include <shardopt/check.h>

namespace shardopt::detail {

bool cuda_kernels_built() { return false; }

void cuda_adam(const std::vector<CudaAdamOperands>&, const AdamScalars&, int64_t) {
  SHARDOPT_CHECK(false, "this shardopt was built without CUDA kernels");
}

void cuda_sgd(const at::Tensor&, const at::Tensor&, const at::Tensor&, const SgdScalars&) {
  SHARDOPT_CHECK(false, "this shardopt was built without CUDA kernels");
}

at::Tensor cuda_norm(const std::vector<at::Tensor>&, bool) { return {}; }

}  // namespace shardopt::detail
