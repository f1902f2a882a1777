/* The fused Adam / AdamW step on 8-bit moments: blockwise codes of a dynamic map, as the CPU
 * step keeps them (Note [8-bit state] in csrc/optim/state_codes.cpp), in one pass.
 *
 * State. Each moment of the segment is one byte per element (a code: an index into a map of 256
 * ascending fp32 values) and one fp32 scale per block of SHARDOPT_ADAMW8_BLOCK consecutive
 * elements from the segment's element 0 (the last block may be short); an element's value is
 * map[code] * scale. The first moment uses `signed_map`, the second (and AMSGrad's running
 * maximum) `unsigned_map`.
 *
 * Math. Per block, each element's moments are decoded, the element takes shardopt_adamw_fp32's
 * update (adamw.h: the same operations, in the same order, rounded the same way), and then each
 * moment of the block is coded again from its new values: the block's scale becomes the largest
 * magnitude among them (at least 1e-12; NaN where a value is NaN), and each value's code the
 * map's nearest value to value / scale (the division rounded to nearest even): an eight-step
 * binary search for the largest code whose value is at most x (0 below the map), then one up
 * where x - map[c] >= (map[c + 1] - map[c]) * 0.5 (c below 255). Every operation is one fp32
 * operation, so the codes, scales and parameters are bit for bit those of the CPU step on the
 * same inputs and maps (csrc/optim/fused_kernels.inc, adam8_loop; state_codes.cpp, code_of).
 *
 * Skip on inf, inv_scale, asynchrony, maximize and the hyper-parameters' ranges: as in adamw.h.
 *
 * Buffers. Device memory of the current device: param and grad (n floats each), the codes (n
 * bytes each), the scales (one float per block: (n + SHARDOPT_ADAMW8_BLOCK - 1) /
 * SHARDOPT_ADAMW8_BLOCK), and the maps (256 floats each, read only). None overlaps another, the
 * maps excepted (they may be one buffer); floats are 4-byte aligned. max_exp_avg_sq and its
 * scales are read and written only with hparams->amsgrad (may be NULL otherwise). n == 0
 * enqueues nothing. Buffers missing, misaligned or overlapping, or n < 0, return
 * SHARDOPT_KERNEL_INVALID_ARGUMENT. */
#ifndef SHARDOPT_KERNELS_ADAMW8_H_
#define SHARDOPT_KERNELS_ADAMW8_H_

#include <stdint.h>

#include <shardopt_kernels/adamw.h>
#include <shardopt_kernels/status.h>
#include <shardopt_kernels/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per block of codes, each with one scale. */
#define SHARDOPT_ADAMW8_BLOCK 256

/* One segment on 8-bit moments.
 *   param                    read and written: the fp32 parameters
 *   grad                     read: the fp32 gradients
 *   exp_avg, exp_avg_scale   read and written: the first moment's codes and block scales
 *   exp_avg_sq, exp_avg_sq_scale
 *                            read and written: the second moment's
 *   max_exp_avg_sq, max_exp_avg_sq_scale
 *                            read and written with AMSGrad: the running maximum's
 *   n                        elements */
typedef struct shardopt_adamw8_segment {
  float* param;
  const float* grad;
  uint8_t* exp_avg;
  float* exp_avg_scale;
  uint8_t* exp_avg_sq;
  float* exp_avg_sq_scale;
  uint8_t* max_exp_avg_sq;
  float* max_exp_avg_sq_scale;
  int64_t n;
} shardopt_adamw8_segment;

/* The step on one segment (host struct, read during the call); the maps are device pointers. */
shardopt_kernel_status shardopt_adamw8(const shardopt_adamw8_segment* segment, const shardopt_adamw_hparams* hparams,
                                       const float* signed_map, const float* unsigned_map, const float* inv_scale,
                                       const float* found_inf, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_ADAMW8_H_ */
