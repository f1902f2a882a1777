/* The fused SGD step over one flat segment, with momentum, dampening, Nesterov momentum and
 * weight decay, in one pass.
 *
 * Math. With g the gradient as read, per element, in this order (torch.optim.SGD, and the same
 * operations, roundings included, as the CPU fused step in csrc/optim/fused_kernels.inc):
 *
 *     g = g * inv_scale                        (when inv_scale is given: unscale folded in)
 *     g = -g                                   (when maximize)
 *     d = fma(p, weight_decay, g)              (weight_decay != 0; otherwise d = g)
 *     buf = first_step ? d                     (momentum != 0: the buffer starts as d, unread)
 *                      : fma(d, 1 - dampening, buf * momentum)
 *     d = nesterov ? fma(buf, momentum, d) : buf        (momentum != 0)
 *     p = fma(d, -lr, p)
 *
 * The scalars 1 - dampening and -lr are computed in double on the host, then rounded to float;
 * every other operation is one fp32 operation rounded to nearest even (fma: one rounding),
 * never contracted. The result is bit-identical to the CPU step on the same inputs.
 *
 * Skip on inf, asynchrony, buffers (alignment, vector path, no overlap) and sizes: as in
 * adamw.h. In short: the call validates on the host and enqueues on `stream` without
 * synchronising; *found_inf != 0 when the kernel runs makes it write nothing; buffers hold
 * `n` elements of device memory each, aligned to their element size, and do not overlap;
 * n may exceed 2^31; n == 0 enqueues nothing. */
#ifndef SHARDOPT_KERNELS_SGD_H_
#define SHARDOPT_KERNELS_SGD_H_

#include <stdint.h>

#include <shardopt_kernels/status.h>
#include <shardopt_kernels/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The hyper-parameters of one step. Values out of range return SHARDOPT_KERNEL_INVALID_ARGUMENT
 * (the ranges are torch.optim's: Nesterov needs momentum > 0 and dampening == 0). */
typedef struct shardopt_sgd_hparams {
  double lr;           /* >= 0 */
  double momentum;     /* >= 0; 0: no momentum buffer */
  double dampening;    /* any finite value; torch.optim's default is 0 */
  double weight_decay; /* >= 0 */
  int nesterov;        /* nonzero: Nesterov momentum */
  int maximize;        /* nonzero: ascend the objective (negate the gradient) */
  int first_step;      /* nonzero: the momentum buffer is initialised, not read (its first step) */
} shardopt_sgd_hparams;

/* The step in fp32.
 *   param         read and written: the parameters
 *   grad          read: the gradients (scaled by 1 / *inv_scale when inv_scale is given)
 *   momentum_buf  when momentum != 0: read (unless first_step) and written, the momentum buffer;
 *                 not accessed (may be NULL) when momentum == 0
 *   n             elements in each buffer
 *   hparams       host pointer, read during the call
 *   inv_scale     NULL, or a device float read by the kernel: the gradient's unscale factor
 *   found_inf     NULL, or a device float read by the kernel: nonzero skips the step
 *   stream        the stream the kernel is enqueued on */
shardopt_kernel_status shardopt_sgd_fp32(float* param, const float* grad, float* momentum_buf, int64_t n,
                                         const shardopt_sgd_hparams* hparams, const float* inv_scale,
                                         const float* found_inf, cudaStream_t stream);

/* The mixed-precision step: fp32 master weights and momentum buffer, a low-precision copy of the
 * parameters, and gradients in the copy's dtype or fp32. The master takes the update above (the
 * gradient converted to fp32 exactly), and the copy becomes the updated master rounded to
 * nearest even, in the same pass.
 *   param         written: the low-precision parameters; never read
 *   param_dtype   SHARDOPT_KERNEL_BFLOAT16 or SHARDOPT_KERNEL_FLOAT16
 *   grad          read: the gradients
 *   grad_dtype    param_dtype or SHARDOPT_KERNEL_FLOAT32
 *   master        read and written: the fp32 master weights
 *   momentum_buf, n, hparams, inv_scale, found_inf, stream
 *                 as for shardopt_sgd_fp32 (the buffer in fp32)
 * With found_inf set, the copy is not written either. */
shardopt_kernel_status shardopt_sgd_mixed(void* param, shardopt_kernel_dtype param_dtype, const void* grad,
                                          shardopt_kernel_dtype grad_dtype, float* master, float* momentum_buf,
                                          int64_t n, const shardopt_sgd_hparams* hparams, const float* inv_scale,
                                          const float* found_inf, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif /* SHARDOPT_KERNELS_SGD_H_ */
