/* The fused Adam / AdamW step over one flat segment: one pass that reads each element's
 * gradient and state once and writes the parameter and the state once.
 *
 * Math. With g the gradient as read, per element, in this order (torch.optim.Adam / AdamW, and
 * the same operations, roundings included, as the CPU fused step in csrc/optim/fused_kernels.inc):
 *
 *     g = g * inv_scale                        (when inv_scale is given: unscale folded in)
 *     g = -g                                   (when maximize)
 *     p = p * (1 - lr * weight_decay)          (AdamW: decoupled, weight_decay != 0)
 *     g = fma(p, weight_decay, g)              (Adam: not decoupled, weight_decay != 0)
 *     m = fma(g, 1 - beta1, m * beta1)
 *     v = v * beta2 + ((1 - beta2) * g) * g
 *     v_max = max(v_max, v)                    (amsgrad; a NaN in either gives NaN)
 *     denom = fma(sqrt(amsgrad ? v_max : v), 1 / sqrt(bc2), eps)
 *     p = p + (-(lr / bc1) * m) / denom
 *
 * where bc1 = 1 - beta1^step and bc2 = 1 - beta2^step. The scalars 1 - beta1, 1 - beta2,
 * 1 - lr * weight_decay, 1 / sqrt(bc2) and -(lr / bc1) are computed in double on the host,
 * then rounded to float; every other operation is one fp32 operation rounded to nearest even
 * (fma: one rounding), never contracted. The result is bit-identical to the CPU step on the
 * same inputs.
 *
 * Skip on inf: when found_inf is given and *found_inf != 0 at the time the kernel runs, the
 * kernel writes nothing at all (parameter, copy and state keep their bits): the gradient
 * scaler's skipped step, decided on the device without a host synchronisation.
 *
 * Asynchrony. Each entry point validates its arguments on the host, enqueues its kernel on
 * `stream` (of the current device) and returns; it does not synchronise. Every buffer must stay
 * allocated, and must not be written by other work, until the kernel has run; the hyper-
 * parameter struct is read during the call only. inv_scale and found_inf are read once by each
 * thread, when the kernel starts.
 *
 * Buffers. All are device memory (or managed memory) of the current device, `n` elements each
 * unless said otherwise. No two of them overlap, inv_scale and found_inf included. Each must be
 * aligned to its element size (cudaMalloc memory at any element offset is). When the addresses,
 * all advanced by one number of elements below the vector width (4 in the fp32 step, 8 in the
 * mixed one), fall on 16-byte boundaries, as they do at a common element offset into
 * 16-byte-aligned allocations (the shards of one flat layout), the kernel moves 16-byte vectors
 * and handles the few elements before and after them one by one; otherwise it moves single
 * elements throughout, with the same results.
 *
 * Sizes. n is an int64_t: a segment may hold more than 2^31 elements. n == 0 enqueues nothing
 * and returns SHARDOPT_KERNEL_OK once the hyper-parameters (and dtypes) pass; the buffers are
 * then not checked. Buffers that overlap, or that are misaligned or missing, return
 * SHARDOPT_KERNEL_INVALID_ARGUMENT. */
#ifndef SHARDOPT_KERNELS_ADAMW_H_
#define SHARDOPT_KERNELS_ADAMW_H_

#include <stdint.h>

#include <shardopt_kernels/status.h>
#include <shardopt_kernels/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The hyper-parameters of one step. Values out of range return SHARDOPT_KERNEL_INVALID_ARGUMENT
 * (the ranges are torch.optim's). */
typedef struct shardopt_adamw_hparams {
  double lr;           /* >= 0 */
  double beta1;        /* in [0, 1) */
  double beta2;        /* in [0, 1) */
  double eps;          /* >= 0 */
  double weight_decay; /* >= 0 */
  int64_t step;        /* the step being taken, counted from 1: the bias corrections' exponent */
  int decoupled;       /* nonzero: AdamW (decay the parameter); zero: Adam (decay into the gradient) */
  int amsgrad;         /* nonzero: normalise by the running maximum of exp_avg_sq */
  int maximize;        /* nonzero: ascend the objective (negate the gradient) */
} shardopt_adamw_hparams;

/* The step in fp32.
 *   param           read and written: the parameters
 *   grad            read: the gradients (scaled by 1 / *inv_scale when inv_scale is given)
 *   exp_avg         read and written: the first moment
 *   exp_avg_sq      read and written: the second moment
 *   max_exp_avg_sq  read and written when hparams->amsgrad: the running maximum of exp_avg_sq;
 *                   not accessed (may be NULL) otherwise
 *   n               elements in each buffer
 *   hparams         host pointer, read during the call
 *   inv_scale       NULL, or a device float read by the kernel: the gradient's unscale factor
 *   found_inf       NULL, or a device float read by the kernel: nonzero skips the step
 *   stream          the stream the kernel is enqueued on */
shardopt_kernel_status shardopt_adamw_fp32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                                           float* max_exp_avg_sq, int64_t n, const shardopt_adamw_hparams* hparams,
                                           const float* inv_scale, const float* found_inf, cudaStream_t stream);

/* The mixed-precision step: fp32 master weights and state, a low-precision copy of the
 * parameters, and gradients in the copy's dtype or fp32. The master takes the update above
 * (the gradient converted to fp32 exactly), and the copy becomes the updated master rounded to
 * nearest even, in the same pass.
 *   param           written: the low-precision parameters (what forward and backward use);
 *                   never read
 *   param_dtype     SHARDOPT_KERNEL_BFLOAT16 or SHARDOPT_KERNEL_FLOAT16
 *   grad            read: the gradients
 *   grad_dtype      param_dtype or SHARDOPT_KERNEL_FLOAT32
 *   master          read and written: the fp32 master weights
 *   exp_avg, exp_avg_sq, max_exp_avg_sq, n, hparams, inv_scale, found_inf, stream
 *                   as for shardopt_adamw_fp32 (state in fp32)
 * With found_inf set, the copy is not written either. */
shardopt_kernel_status shardopt_adamw_mixed(void* param, shardopt_kernel_dtype param_dtype, const void* grad,
                                            shardopt_kernel_dtype grad_dtype, float* master, float* exp_avg,
                                            float* exp_avg_sq, float* max_exp_avg_sq, int64_t n,
                                            const shardopt_adamw_hparams* hparams, const float* inv_scale,
                                            const float* found_inf, cudaStream_t stream);

/* Many segments in few launches: one step of the same hyper-parameters over a list of segments
 * (the parameters of one optimizer group, each its own allocation), as ATen's multi-tensor
 * _fused_adamw_ does. Each launch takes up to SHARDOPT_ADAMW_SEGMENTS_PER_LAUNCH segments, passed
 * by value as the kernel's argument (no descriptor in device memory, no copy to the device), and
 * each segment is cut into chunks of whole 16-byte vectors that the blocks share out; a segment's
 * results are bit for bit those of the single-segment entry point on it. Segments with n == 0 are
 * skipped without their buffers being checked. The list is read during the call only. Each
 * segment's buffers follow the rules above, and no two buffers of the whole list overlap. */
#define SHARDOPT_ADAMW_SEGMENTS_PER_LAUNCH 32

/* One segment of a list.
 *   param           the fp32 step: the fp32 parameters (float*, read and written);
 *                   the mixed step: the low-precision copy (written only)
 *   grad            the gradients: fp32 in the fp32 step; the copy's dtype or fp32 in the mixed one
 *   master          the mixed step: the fp32 master weights (read and written); the fp32 step:
 *                   must be NULL
 *   exp_avg, exp_avg_sq, max_exp_avg_sq, n
 *                   as for shardopt_adamw_fp32 */
typedef struct shardopt_adamw_segment {
  void* param;
  const void* grad;
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  int64_t n;
} shardopt_adamw_segment;

/* shardopt_adamw_fp32 over `count` segments (host array). */
shardopt_kernel_status shardopt_adamw_fp32_segments(const shardopt_adamw_segment* segments, int64_t count,
                                                    const shardopt_adamw_hparams* hparams, const float* inv_scale,
                                                    const float* found_inf, cudaStream_t stream);

/* shardopt_adamw_mixed over `count` segments (host array), every copy of param_dtype and every
 * gradient of grad_dtype. */
shardopt_kernel_status shardopt_adamw_mixed_segments(const shardopt_adamw_segment* segments, int64_t count,
                                                     shardopt_kernel_dtype param_dtype,
                                                     shardopt_kernel_dtype grad_dtype,
                                                     const shardopt_adamw_hparams* hparams, const float* inv_scale,
                                                     const float* found_inf, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_ADAMW_H_ */
