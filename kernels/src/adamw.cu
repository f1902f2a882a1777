// The fused Adam / AdamW step (shardopt_kernels/adamw.h): a checked host entry and one kernel
// template over the buffers' element types; the per-element math is adam_math.cuh's.
#include <shardopt_kernels/adamw.h>

#include "adam_math.cuh"
#include "common.cuh"

#include <cmath>
#include <vector>

namespace shardopt_kernels {
namespace {

// The buffers of one segment. CopyT is void in the fp32 step (there the master is the parameter).
template <class GradT, class CopyT>
struct AdamBuffers {
  float* master;
  const GradT* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  CopyT* copy;
};

// Loads the Width elements at i, updates them, stores them.
template <int Width, bool kAmsgrad, class GradT, class CopyT>
__device__ __forceinline__ void adam_pack(const AdamBuffers<GradT, CopyT>& b, int64_t i, float grad_factor,
                                          const AdamScalars& s) {
  Pack<float, Width> p = load<Width>(b.master + i);
  Pack<float, Width> m = load<Width>(b.exp_avg + i);
  Pack<float, Width> v = load<Width>(b.exp_avg_sq + i);
  const Pack<GradT, Width> g = load_readonly<Width>(b.grad + i);
  Pack<float, Width> v_max{};
  if constexpr (kAmsgrad) v_max = load<Width>(b.max_exp_avg_sq + i);
#pragma unroll
  for (int k = 0; k < Width; ++k) {
    adam_element<kAmsgrad>(p.v[k], __fmul_rn(to_float(g.v[k]), grad_factor), m.v[k], v.v[k], v_max.v[k], s);
  }
  store<Width>(b.master + i, p);
  store<Width>(b.exp_avg + i, m);
  store<Width>(b.exp_avg_sq + i, v);
  if constexpr (kAmsgrad) store<Width>(b.max_exp_avg_sq + i, v_max);
  if constexpr (!std::is_void_v<CopyT>) store<Width>(b.copy + i, round_pack<CopyT>(p));
}

// sign is -1 to maximize, 1 otherwise; it and *inv_scale fold into one exact factor of the gradient
// (a product with -1 only flips the sign bit).
template <int Width, bool kAmsgrad, class GradT, class CopyT>
__global__ void __launch_bounds__(kThreads)
    adam_kernel(AdamBuffers<GradT, CopyT> b, int64_t n, Split split, AdamScalars s, float sign,
                const float* __restrict__ inv_scale, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const float grad_factor = inv_scale != nullptr ? __fmul_rn(sign, *inv_scale) : sign;
  for_each_pack<Width>(n, split, [&](auto width, int64_t i) {
    adam_pack<decltype(width)::value, kAmsgrad>(b, i, grad_factor, s);
  });
}

template <class GradT, class CopyT>
shardopt_kernel_status launch(const AdamBuffers<GradT, CopyT>& b, int64_t n, const shardopt_adamw_hparams& h,
                              const float* inv_scale, const float* found_inf, cudaStream_t stream) {
  using Copy = std::conditional_t<std::is_void_v<CopyT>, float, CopyT>;
  constexpr int kWidth = kVectorBytes / static_cast<int>(std::min(sizeof(GradT), sizeof(Copy)));
  const Split split = split_for_vectors(n, kWidth,
                                        {{b.master, 4}, {b.grad, sizeof(GradT)}, {b.exp_avg, 4}, {b.exp_avg_sq, 4},
                                         {b.max_exp_avg_sq, 4}, {b.copy, sizeof(Copy)}});
  auto* kernel = h.amsgrad ? adam_kernel<kWidth, true, GradT, CopyT> : adam_kernel<kWidth, false, GradT, CopyT>;
  int blocks = 0;
  SHARDOPT_CUDA_TRY(blocks_for(kernel, std::max(split.vectors, n - split.vectors * kWidth), &blocks));
  kernel<<<blocks, kThreads, 0, stream>>>(b, n, split, scalars_of(h), h.maximize ? -1.0f : 1.0f, inv_scale,
                                          found_inf);
  SHARDOPT_CUDA_TRY(cudaGetLastError());
  return SHARDOPT_KERNEL_OK;
}

// The checks both entry points share once the element types are known.
template <class GradT, class CopyT>
shardopt_kernel_status checked_launch(const AdamBuffers<GradT, CopyT>& b, int64_t n, const shardopt_adamw_hparams& h,
                                      const float* inv_scale, const float* found_inf, cudaStream_t stream) {
  using Copy = std::conditional_t<std::is_void_v<CopyT>, float, CopyT>;
  const bool usable_buffers = usable(b.master, 4) && usable(b.grad, sizeof(GradT)) && usable(b.exp_avg, 4) &&
                              usable(b.exp_avg_sq, 4) && (!h.amsgrad || usable(b.max_exp_avg_sq, 4)) &&
                              (std::is_void_v<CopyT> || usable(b.copy, sizeof(Copy))) &&
                              usable_if_given(inv_scale, 4) && usable_if_given(found_inf, 4);
  if (!usable_buffers ||
      !disjoint({bytes_of(b.master, n, 4), bytes_of(b.grad, n, sizeof(GradT)), bytes_of(b.exp_avg, n, 4),
                 bytes_of(b.exp_avg_sq, n, 4), bytes_of(b.max_exp_avg_sq, n, 4), bytes_of(b.copy, n, sizeof(Copy)),
                 bytes_of(inv_scale, 1, 4), bytes_of(found_inf, 1, 4)})) {
    return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  }
  return launch(b, n, h, inv_scale, found_inf, stream);
}

// ---- many segments per launch --------------------------------------------------------------------

// The segments of one launch, passed by value (__grid_constant__: read in place from the kernel's
// parameter space, indexed at run time without a local copy). A chunk is kThreads work items, one
// per thread: segment k's vectors are the chunks [first_chunk[k], first_chunk[k + 1]), and its
// elements outside them (for_each_pack's singles) the chunks [first_single[k], first_single[k + 1])
// of a second count.
constexpr int kSegmentsPerLaunch = SHARDOPT_ADAMW_SEGMENTS_PER_LAUNCH;

template <class GradT, class CopyT>
struct SegmentTable {
  AdamBuffers<GradT, CopyT> buffers[kSegmentsPerLaunch];
  int64_t n[kSegmentsPerLaunch];
  Split split[kSegmentsPerLaunch];
  int64_t first_chunk[kSegmentsPerLaunch + 1];
  int64_t first_single[kSegmentsPerLaunch + 1];
  int count;
};

// The vectors' chunks, then the singles' chunks, in two loops as in for_each_pack. Each block takes
// every gridDim.x-th chunk in ascending order, so its segment only moves forward. A segment's
// buffers are copied into registers before use: stepped through a reference into the parameter
// space, nvcc stored each packed element on its own instead of as 16-byte vectors.
template <int Width, bool kAmsgrad, class GradT, class CopyT>
__global__ void __launch_bounds__(kThreads)
    adam_segments_kernel(const __grid_constant__ SegmentTable<GradT, CopyT> t, AdamScalars s, float sign,
                         const float* __restrict__ inv_scale, const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  const float grad_factor = inv_scale != nullptr ? __fmul_rn(sign, *inv_scale) : sign;
  int k = 0;
  for (int64_t c = blockIdx.x; c < t.first_chunk[t.count]; c += gridDim.x) {
    while (c >= t.first_chunk[k + 1]) ++k;
    const int64_t item = (c - t.first_chunk[k]) * kThreads + threadIdx.x;
    if (item < t.split[k].vectors) {
      const AdamBuffers<GradT, CopyT> b = t.buffers[k];
      adam_pack<Width, kAmsgrad>(b, t.split[k].head + item * Width, grad_factor, s);
    }
  }
  k = 0;
  for (int64_t c = blockIdx.x; c < t.first_single[t.count]; c += gridDim.x) {
    while (c >= t.first_single[k + 1]) ++k;
    const int64_t j = (c - t.first_single[k]) * kThreads + threadIdx.x;  // the j-th element outside the vectors
    const Split split = t.split[k];
    if (j < t.n[k] - split.vectors * Width) {
      const AdamBuffers<GradT, CopyT> b = t.buffers[k];
      adam_pack<1, kAmsgrad>(b, j < split.head ? j : split.head + split.vectors * Width + (j - split.head),
                             grad_factor, s);
    }
  }
}

template <class GradT, class CopyT>
shardopt_kernel_status launch_segments(const SegmentTable<GradT, CopyT>& t, const shardopt_adamw_hparams& h,
                                       const float* inv_scale, const float* found_inf, cudaStream_t stream) {
  using Copy = std::conditional_t<std::is_void_v<CopyT>, float, CopyT>;
  constexpr int kWidth = kVectorBytes / static_cast<int>(std::min(sizeof(GradT), sizeof(Copy)));
  auto* kernel = h.amsgrad ? adam_segments_kernel<kWidth, true, GradT, CopyT>
                           : adam_segments_kernel<kWidth, false, GradT, CopyT>;
  int blocks = 0;
  SHARDOPT_CUDA_TRY(
      blocks_for(kernel, std::max(t.first_chunk[t.count], t.first_single[t.count]) * kThreads, &blocks));
  kernel<<<blocks, kThreads, 0, stream>>>(t, scalars_of(h), h.maximize ? -1.0f : 1.0f, inv_scale, found_inf);
  SHARDOPT_CUDA_TRY(cudaGetLastError());
  return SHARDOPT_KERNEL_OK;
}

// Checks the whole list (each buffer usable, none overlapping another of any segment), then
// launches it in tables of kSegmentsPerLaunch non-empty segments.
template <class GradT, class CopyT>
shardopt_kernel_status checked_segments(const shardopt_adamw_segment* segments, int64_t count,
                                        const shardopt_adamw_hparams& h, const float* inv_scale,
                                        const float* found_inf, cudaStream_t stream) {
  using Copy = std::conditional_t<std::is_void_v<CopyT>, float, CopyT>;
  constexpr bool kMixed = !std::is_void_v<CopyT>;
  constexpr int kWidth = kVectorBytes / static_cast<int>(std::min(sizeof(GradT), sizeof(Copy)));
  if (count < 0 || (count > 0 && segments == nullptr)) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  if (!usable_if_given(inv_scale, 4) || !usable_if_given(found_inf, 4)) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  std::vector<ByteRange> ranges{bytes_of(inv_scale, 1, 4), bytes_of(found_inf, 1, 4)};
  std::vector<AdamBuffers<GradT, CopyT>> buffers;
  std::vector<int64_t> sizes;
  for (int64_t k = 0; k < count; ++k) {
    const shardopt_adamw_segment& seg = segments[k];
    if (seg.n < 0) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
    if (seg.n == 0) continue;
    AdamBuffers<GradT, CopyT> b{};
    if constexpr (kMixed) {
      b = {seg.master, static_cast<const GradT*>(seg.grad), seg.exp_avg, seg.exp_avg_sq,
           h.amsgrad ? seg.max_exp_avg_sq : nullptr, static_cast<CopyT*>(seg.param)};
    } else {
      if (seg.master != nullptr) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
      b = {static_cast<float*>(seg.param), static_cast<const GradT*>(seg.grad), seg.exp_avg, seg.exp_avg_sq,
           h.amsgrad ? seg.max_exp_avg_sq : nullptr, nullptr};
    }
    if (!(usable(b.master, 4) && usable(b.grad, sizeof(GradT)) && usable(b.exp_avg, 4) && usable(b.exp_avg_sq, 4) &&
          (!h.amsgrad || usable(b.max_exp_avg_sq, 4)) && (!kMixed || usable(b.copy, sizeof(Copy))))) {
      return SHARDOPT_KERNEL_INVALID_ARGUMENT;
    }
    for (const ByteRange& r : {bytes_of(b.master, seg.n, 4), bytes_of(b.grad, seg.n, sizeof(GradT)),
                               bytes_of(b.exp_avg, seg.n, 4), bytes_of(b.exp_avg_sq, seg.n, 4),
                               bytes_of(b.max_exp_avg_sq, seg.n, 4), bytes_of(b.copy, seg.n, sizeof(Copy))}) {
      ranges.push_back(r);
    }
    buffers.push_back(b);
    sizes.push_back(seg.n);
  }
  if (!disjoint_sorted(ranges.data(), ranges.size())) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  for (size_t first = 0; first < buffers.size(); first += kSegmentsPerLaunch) {
    SegmentTable<GradT, CopyT> t{};
    t.count = static_cast<int>(std::min<size_t>(kSegmentsPerLaunch, buffers.size() - first));
    for (int k = 0; k < t.count; ++k) {
      const AdamBuffers<GradT, CopyT>& b = buffers[first + k];
      const int64_t n = sizes[first + k];
      t.buffers[k] = b;
      t.n[k] = n;
      t.split[k] = split_for_vectors(n, kWidth,
                                     {{b.master, 4}, {b.grad, sizeof(GradT)}, {b.exp_avg, 4}, {b.exp_avg_sq, 4},
                                      {b.max_exp_avg_sq, 4}, {b.copy, sizeof(Copy)}});
      const int64_t vectors = t.split[k].vectors, singles = n - vectors * kWidth;
      t.first_chunk[k + 1] = t.first_chunk[k] + (vectors + kThreads - 1) / kThreads;
      t.first_single[k + 1] = t.first_single[k] + (singles + kThreads - 1) / kThreads;
    }
    const shardopt_kernel_status status = launch_segments(t, h, inv_scale, found_inf, stream);
    if (status != SHARDOPT_KERNEL_OK) return status;
  }
  return SHARDOPT_KERNEL_OK;
}

}  // namespace
}  // namespace shardopt_kernels

using namespace shardopt_kernels;

extern "C" shardopt_kernel_status shardopt_adamw_fp32_segments(const shardopt_adamw_segment* segments, int64_t count,
                                                               const shardopt_adamw_hparams* hparams,
                                                               const float* inv_scale, const float* found_inf,
                                                               cudaStream_t stream) {
  if (!valid(hparams)) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  return checked_segments<float, void>(segments, count, *hparams, inv_scale, found_inf, stream);
}

extern "C" shardopt_kernel_status shardopt_adamw_mixed_segments(const shardopt_adamw_segment* segments, int64_t count,
                                                                shardopt_kernel_dtype param_dtype,
                                                                shardopt_kernel_dtype grad_dtype,
                                                                const shardopt_adamw_hparams* hparams,
                                                                const float* inv_scale, const float* found_inf,
                                                                cudaStream_t stream) {
  if (!valid(hparams)) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  return dispatch_mixed(param_dtype, grad_dtype, [&](auto copy_tag, auto grad_tag) {
    using CopyT = typename decltype(copy_tag)::type;
    using GradT = typename decltype(grad_tag)::type;
    return checked_segments<GradT, CopyT>(segments, count, *hparams, inv_scale, found_inf, stream);
  });
}

extern "C" shardopt_kernel_status shardopt_adamw_fp32(float* param, const float* grad, float* exp_avg,
                                                      float* exp_avg_sq, float* max_exp_avg_sq, int64_t n,
                                                      const shardopt_adamw_hparams* hparams, const float* inv_scale,
                                                      const float* found_inf, cudaStream_t stream) {
  if (!valid(hparams) || n < 0) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  if (n == 0) return SHARDOPT_KERNEL_OK;
  const AdamBuffers<float, void> buffers{param, grad, exp_avg, exp_avg_sq, hparams->amsgrad ? max_exp_avg_sq : nullptr,
                                         nullptr};
  return checked_launch(buffers, n, *hparams, inv_scale, found_inf, stream);
}

extern "C" shardopt_kernel_status shardopt_adamw_mixed(void* param, shardopt_kernel_dtype param_dtype,
                                                       const void* grad, shardopt_kernel_dtype grad_dtype,
                                                       float* master, float* exp_avg, float* exp_avg_sq,
                                                       float* max_exp_avg_sq, int64_t n,
                                                       const shardopt_adamw_hparams* hparams, const float* inv_scale,
                                                       const float* found_inf, cudaStream_t stream) {
  if (!valid(hparams) || n < 0) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  return dispatch_mixed(param_dtype, grad_dtype, [&](auto copy_tag, auto grad_tag) {
    using CopyT = typename decltype(copy_tag)::type;
    using GradT = typename decltype(grad_tag)::type;
    if (n == 0) return SHARDOPT_KERNEL_OK;
    const AdamBuffers<GradT, CopyT> buffers{master, static_cast<const GradT*>(grad), exp_avg, exp_avg_sq,
                                            hparams->amsgrad ? max_exp_avg_sq : nullptr, static_cast<CopyT*>(param)};
    return checked_launch(buffers, n, *hparams, inv_scale, found_inf, stream);
  });
}
