/* The element types and the stream type that the kernel entry points share.
 *
 * The headers of kernels/ compile as C99 without the CUDA toolkit, so they declare the CUDA
 * runtime's stream handle themselves: cudaStream_t is `struct CUstream_st*` in the runtime's
 * driver_types.h, and the same type here. C++ and C11 accept the two declarations in either
 * order; C99 accepts them only with the toolkit's header included first (then this header
 * declares nothing). */
#ifndef SHARDOPT_KERNELS_TYPES_H_
#define SHARDOPT_KERNELS_TYPES_H_

#ifdef __cplusplus
extern "C" {
#endif

#ifndef __DRIVER_TYPES_H__
typedef struct CUstream_st* cudaStream_t;
#endif

/* The element type of a buffer that an entry point takes as `void*`. Each kind of buffer
 * accepts only some of them; its header says which. */
typedef enum shardopt_kernel_dtype {
  SHARDOPT_KERNEL_FLOAT32 = 0,  /* IEEE binary32 */
  SHARDOPT_KERNEL_BFLOAT16 = 1, /* bfloat16: binary32's upper 16 bits */
  SHARDOPT_KERNEL_FLOAT16 = 2   /* IEEE binary16 */
} shardopt_kernel_dtype;

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_TYPES_H_ */
