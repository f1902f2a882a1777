/* Status codes of the CUDA kernel layer to come.
 *
 * No kernel or entry point exists yet, and nothing in csrc/ includes this header; the build
 * only compiles it as C99. The contract for the kernels to come: kernels/ is a C ABI whose
 * headers take raw pointers, int64_t element counts and a cudaStream_t last, and carry no
 * LibTorch (or other C++) types; csrc/ is to adapt tensors to it. Every entry point is to
 * return a shardopt_kernel_status, which the caller checks at every call. */
#ifndef SHARDOPT_KERNELS_STATUS_H_
#define SHARDOPT_KERNELS_STATUS_H_

#ifdef __cplusplus
extern "C" {
#endif

typedef enum shardopt_kernel_status {
  SHARDOPT_KERNEL_OK = 0,
  SHARDOPT_KERNEL_INVALID_ARGUMENT = 1, /* a null pointer, a negative count, a misaligned buffer */
  SHARDOPT_KERNEL_CUDA_ERROR = 2        /* a CUDA runtime call failed; cudaGetLastError() says which */
} shardopt_kernel_status;

/* A short English name of `status`, for error messages. */
static inline const char* shardopt_kernel_status_string(shardopt_kernel_status status) {
  switch (status) {
    case SHARDOPT_KERNEL_OK: return "ok";
    case SHARDOPT_KERNEL_INVALID_ARGUMENT: return "invalid argument";
    case SHARDOPT_KERNEL_CUDA_ERROR: return "CUDA error";
  }
  return "unknown status";
}

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_STATUS_H_ */
