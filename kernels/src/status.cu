// The CUDA error behind the latest SHARDOPT_KERNEL_CUDA_ERROR of this thread (shardopt_kernels/status.h).
#include "common.cuh"

namespace shardopt_kernels {
namespace {

thread_local cudaError_t last_cuda_error = cudaSuccess;

}  // namespace

shardopt_kernel_status cuda_failure(cudaError_t error) {
  last_cuda_error = error;
  return SHARDOPT_KERNEL_CUDA_ERROR;
}

}  // namespace shardopt_kernels

extern "C" int shardopt_kernel_last_cuda_error(void) { return static_cast<int>(shardopt_kernels::last_cuda_error); }
