/* Status codes of the CUDA kernel layer (kernels/).
 *
 * kernels/ is a C ABI: its headers take raw pointers, int64_t element counts and a cudaStream_t
 * last, and carry no LibTorch (or other C++) types; csrc/ adapts tensors to it. Every entry
 * point (adamw.h, sgd.h, norm.h) returns a shardopt_kernel_status, which the caller checks at
 * every call. An entry point checks its arguments before any CUDA call: one that returns
 * SHARDOPT_KERNEL_INVALID_ARGUMENT has enqueued nothing and touched no CUDA state.
 *
 * The entry points live in the static library shardopt_kernels_cuda, built where a CUDA
 * compiler is found; the headers compile as C99 without the CUDA toolkit. */
#ifndef SHARDOPT_KERNELS_STATUS_H_
#define SHARDOPT_KERNELS_STATUS_H_

#ifdef __cplusplus
extern "C" {
#endif

typedef enum shardopt_kernel_status {
  SHARDOPT_KERNEL_OK = 0,
  SHARDOPT_KERNEL_INVALID_ARGUMENT = 1, /* a null pointer, a negative count, a misaligned buffer,
                                           a hyper-parameter out of range, an unknown enum value */
  SHARDOPT_KERNEL_CUDA_ERROR = 2        /* a CUDA runtime call failed:
                                           shardopt_kernel_last_cuda_error() says which */
} shardopt_kernel_status;

/* A short English name of `status`, for error messages. (Marked unused for nvcc: its host pass
 * sees this header inside the preprocessed translation unit, where clang reports unused static
 * inline functions.) */
#if defined(__GNUC__)
__attribute__((unused))
#endif
static inline const char* shardopt_kernel_status_string(shardopt_kernel_status status) {
  switch (status) {
    case SHARDOPT_KERNEL_OK: return "ok";
    case SHARDOPT_KERNEL_INVALID_ARGUMENT: return "invalid argument";
    case SHARDOPT_KERNEL_CUDA_ERROR: return "CUDA error";
  }
  return "unknown status";
}

/* The cudaError_t, as an int, of the CUDA runtime call that made the latest entry point called
 * on this thread return SHARDOPT_KERNEL_CUDA_ERROR; 0 (cudaSuccess) on a thread where none has.
 * cudaGetErrorString((cudaError_t)e) names it.
 *
 * After each kernel launch the entry points take the runtime's pending error with
 * cudaGetLastError() (as ATen does after its launches), so an error left pending by earlier
 * work on this thread is reported by the next entry point and cleared. Errors of kernels that
 * already ran asynchronously (an illegal address) surface at the caller's next synchronising
 * call, as for any CUDA work. */
int shardopt_kernel_last_cuda_error(void);

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_STATUS_H_ */
