// The fused Adam / AdamW step on 8-bit moments (shardopt_kernels/adamw8.h): one CUDA block of
// kThreads threads per block of codes at a time, one element per thread. The maps wait in shared
// memory; a block's new scales are reductions across its threads (warp shuffles, then one value
// per warp through shared memory), after which every thread codes its own values.
#include <shardopt_kernels/adamw8.h>

#include "adam_math.cuh"
#include "common.cuh"

namespace shardopt_kernels {
namespace {

static_assert(SHARDOPT_ADAMW8_BLOCK == kThreads, "a CUDA block codes one block of codes at a time");
constexpr int kWarps = kThreads / 32;
constexpr unsigned kAllLanes = 0xffffffffu;

// The larger magnitude of two running maxima; a NaN, once seen, stays (absmax_step in
// state_codes.h).
__device__ __forceinline__ float absmax_merge(float a, float b) { return isnan(a) ? a : (isnan(b) || b > a ? b : a); }

// The block's largest magnitude of `x` (dead threads give 0), the same in every thread. `slots`
// holds one value per warp; the caller synchronises before the slots are written again.
__device__ __forceinline__ float block_absmax(float x, float* slots) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) x = absmax_merge(x, __shfl_xor_sync(kAllLanes, x, offset));
  if ((threadIdx.x & 31) == 0) slots[threadIdx.x / 32] = x;
  __syncthreads();
  float all = slots[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) all = absmax_merge(all, slots[w]);
  return all;
}

// The code of x = value / scale: state_codes.cpp's code_of, step for step.
__device__ __forceinline__ int code_of(float x, const float* map) {
  int c = x >= map[128] ? 128 : 0;
#pragma unroll
  for (int step = 64; step >= 1; step /= 2) c += x >= map[c + step] ? step : 0;
  const int up = c < 255 ? c + 1 : 255;
  const float down = map[c];
  return __fsub_rn(x, down) >= __fmul_rn(__fsub_rn(map[up], down), 0.5f) ? up : c;
}

// quantise_block's scale: the absolute maximum, at least 1e-12 (NaN kept).
__device__ __forceinline__ float scale_of(float absmax) { return absmax < 1e-12f ? 1e-12f : absmax; }

template <bool kAmsgrad>
__global__ void __launch_bounds__(kThreads)
    adam8_kernel(shardopt_adamw8_segment b, int64_t n, AdamScalars s, float sign, const float* __restrict__ signed_map,
                 const float* __restrict__ unsigned_map, const float* __restrict__ inv_scale,
                 const float* __restrict__ found_inf) {
  if (found_inf != nullptr && *found_inf != 0.0f) return;
  __shared__ float smap[256], umap[256];
  __shared__ float slots[3][kWarps];
  smap[threadIdx.x] = signed_map[threadIdx.x];
  umap[threadIdx.x] = unsigned_map[threadIdx.x];
  __syncthreads();
  const float grad_factor = inv_scale != nullptr ? __fmul_rn(sign, *inv_scale) : sign;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  for (int64_t block = blockIdx.x; block < blocks; block += gridDim.x) {
    const int64_t i = block * kThreads + threadIdx.x;
    const bool live = i < n;
    float m = 0.0f, v = 0.0f, vmax = 0.0f;
    if (live) {
      float p = b.param[i];
      m = __fmul_rn(smap[b.exp_avg[i]], b.exp_avg_scale[block]);
      v = __fmul_rn(umap[b.exp_avg_sq[i]], b.exp_avg_sq_scale[block]);
      if constexpr (kAmsgrad) vmax = __fmul_rn(umap[b.max_exp_avg_sq[i]], b.max_exp_avg_sq_scale[block]);
      adam_element<kAmsgrad>(p, __fmul_rn(__ldg(b.grad + i), grad_factor), m, v, vmax, s);
      b.param[i] = p;
    }
    const float m_scale = scale_of(block_absmax(fabsf(m), slots[0]));
    const float v_scale = scale_of(block_absmax(fabsf(v), slots[1]));
    const float vmax_scale = kAmsgrad ? scale_of(block_absmax(fabsf(vmax), slots[2])) : 0.0f;
    if (live) {
      b.exp_avg[i] = static_cast<uint8_t>(code_of(__fdiv_rn(m, m_scale), smap));
      b.exp_avg_sq[i] = static_cast<uint8_t>(code_of(__fdiv_rn(v, v_scale), umap));
      if constexpr (kAmsgrad) b.max_exp_avg_sq[i] = static_cast<uint8_t>(code_of(__fdiv_rn(vmax, vmax_scale), umap));
    }
    if (threadIdx.x == 0) {
      b.exp_avg_scale[block] = m_scale;
      b.exp_avg_sq_scale[block] = v_scale;
      if constexpr (kAmsgrad) b.max_exp_avg_sq_scale[block] = vmax_scale;
    }
    __syncthreads();  // every thread has read the slots before the next block writes them
  }
}

bool usable_codes(const uint8_t* codes, const float* scales) { return codes != nullptr && usable(scales, 4); }

}  // namespace
}  // namespace shardopt_kernels

using namespace shardopt_kernels;

extern "C" shardopt_kernel_status shardopt_adamw8(const shardopt_adamw8_segment* segment,
                                                  const shardopt_adamw_hparams* hparams, const float* signed_map,
                                                  const float* unsigned_map, const float* inv_scale,
                                                  const float* found_inf, cudaStream_t stream) {
  if (segment == nullptr || !valid(hparams) || segment->n < 0) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  const shardopt_adamw8_segment& g = *segment;
  const int64_t n = g.n;
  if (n == 0) return SHARDOPT_KERNEL_OK;
  const bool amsgrad = hparams->amsgrad != 0;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  if (!usable(g.param, 4) || !usable(g.grad, 4) || !usable_codes(g.exp_avg, g.exp_avg_scale) ||
      !usable_codes(g.exp_avg_sq, g.exp_avg_sq_scale) ||
      (amsgrad && !usable_codes(g.max_exp_avg_sq, g.max_exp_avg_sq_scale)) || !usable(signed_map, 4) ||
      !usable(unsigned_map, 4) || !usable_if_given(inv_scale, 4) || !usable_if_given(found_inf, 4)) {
    return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  }
  shardopt_adamw8_segment b = g;
  if (!amsgrad) b.max_exp_avg_sq = nullptr, b.max_exp_avg_sq_scale = nullptr;
  // Every buffer written, and every other one read, apart; the two maps may be one buffer.
  const ByteRange maps[2] = {bytes_of(signed_map, 256, 4), bytes_of(unsigned_map, 256, 4)};
  for (const ByteRange& map : maps) {
    if (!disjoint({map, bytes_of(b.param, n, 4), bytes_of(b.grad, n, 4), bytes_of(b.exp_avg, n, 1),
                   bytes_of(b.exp_avg_scale, blocks, 4), bytes_of(b.exp_avg_sq, n, 1),
                   bytes_of(b.exp_avg_sq_scale, blocks, 4), bytes_of(b.max_exp_avg_sq, n, 1),
                   bytes_of(b.max_exp_avg_sq_scale, blocks, 4), bytes_of(inv_scale, 1, 4), bytes_of(found_inf, 1, 4)})) {
      return SHARDOPT_KERNEL_INVALID_ARGUMENT;
    }
  }
  auto* kernel = amsgrad ? adam8_kernel<true> : adam8_kernel<false>;
  int grid = 0;
  SHARDOPT_CUDA_TRY(blocks_for(kernel, n, &grid));
  kernel<<<grid, kThreads, 0, stream>>>(b, n, scalars_of(*hparams), hparams->maximize ? -1.0f : 1.0f, signed_map,
                                        unsigned_map, inv_scale, found_inf);
  SHARDOPT_CUDA_TRY(cudaGetLastError());
  return SHARDOPT_KERNEL_OK;
}
