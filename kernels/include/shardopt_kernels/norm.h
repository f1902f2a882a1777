/* The fused norm over several segments: the sum of squares (for an L2 norm) or the largest
 * absolute value (for an inf norm) of every element of every segment, and whether any element
 * is inf or NaN, in one read of the data. Both results stay on the device, so that gradient
 * clipping and the gradient scaler use them without a host synchronisation; across ranks the
 * caller all-reduces them (sum or max for the value, max for the flag), then takes the root.
 *
 *     shardopt_norm_segment* segments;   // device array: {data, count} of each flat buffer
 *     size_t bytes;
 *     shardopt_norm_workspace_bytes(&bytes);
 *     void* workspace;                   // cudaMalloc'ed once, `bytes` long, reused
 *     float *sum_sq, *found_inf;         // device floats
 *     shardopt_norm(segments, count, SHARDOPT_KERNEL_BFLOAT16, SHARDOPT_NORM_L2_SQUARED,
 *                   workspace, bytes, sum_sq, found_inf, stream);
 *
 * Two kernels, enqueued on `stream` (of the current device) without synchronising: stage 1
 * spreads the segments' elements over a grid of blocks (a segment's 16-byte-aligned body in
 * chunks, its unaligned head and tail by one block), each block reducing its share into one
 * partial in the workspace; stage 2, one block, reduces the partials and writes `result` and
 * `found_inf`. Squares are accumulated in double, so the sum neither overflows nor loses small
 * terms before the final rounding to float (a sum beyond FLT_MAX becomes inf, with found_inf
 * still 0 when every element is finite). The summation order depends only on the segments and
 * on the device (the grid fills its multiprocessors): the same inputs give the same bits on one
 * device, run after run.
 *
 * The inf norm is max |x| over the finite and infinite elements; NaN elements do not enter it
 * (they set found_inf).
 *
 * Cost: every block of stage 1 reads every segment's descriptor, so the list is meant for the
 * handful of flat buffers (buckets, shards) of a rank, not for thousands of small tensors. */
#ifndef SHARDOPT_KERNELS_NORM_H_
#define SHARDOPT_KERNELS_NORM_H_

#include <stddef.h>
#include <stdint.h>

#include <shardopt_kernels/status.h>
#include <shardopt_kernels/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* One contiguous buffer of `count` elements. `data` is device memory aligned to the element size
 * (16-byte alignment is not needed: each segment's unaligned head is read element by element);
 * count <= 0 contributes nothing; count may exceed 2^31. */
typedef struct shardopt_norm_segment {
  const void* data;
  int64_t count;
} shardopt_norm_segment;

typedef enum shardopt_norm_kind {
  SHARDOPT_NORM_L2_SQUARED = 0, /* result = sum of x^2 (the L2 norm is its square root) */
  SHARDOPT_NORM_INF = 1         /* result = max |x| */
} shardopt_norm_kind;

/* The bytes of workspace that shardopt_norm needs, whatever the segments and the device. */
shardopt_kernel_status shardopt_norm_workspace_bytes(size_t* bytes);

/* Enqueues the norm of every element of segments[0, num_segments).
 *   segments         device array of num_segments descriptors, read by the kernel (may be NULL
 *                    when num_segments == 0)
 *   num_segments     >= 0; with 0 segments result = 0 and found_inf = 0
 *   dtype            the element type of every segment: FLOAT32, BFLOAT16 or FLOAT16
 *   kind             SHARDOPT_NORM_L2_SQUARED or SHARDOPT_NORM_INF
 *   workspace        device memory, 16-byte aligned, at least shardopt_norm_workspace_bytes()
 *                    long; written by stage 1 and read by stage 2. Calls that may run at the
 *                    same time (on different streams) need different workspaces.
 *   workspace_bytes  the workspace's length
 *   result           device float, written: the sum of squares or the max
 *   found_inf        device float, written: 1 when any element is inf or NaN, 0 otherwise
 *   stream           the stream both kernels are enqueued on
 * The segments' data must not be written until stage 1 has run; result and found_inf may not
 * overlap each other, the workspace or the data. */
shardopt_kernel_status shardopt_norm(const shardopt_norm_segment* segments, int64_t num_segments,
                                     shardopt_kernel_dtype dtype, shardopt_norm_kind kind, void* workspace,
                                     size_t workspace_bytes, float* result, float* found_inf, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_NORM_H_ */
