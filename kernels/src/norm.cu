// The fused multi-segment norm (shardopt_kernels/norm.h): stage 1 reduces each block's share of the
// segments into one partial in the workspace, stage 2 reduces the partials; cub::BlockReduce in both.
#include <shardopt_kernels/norm.h>

#include "common.cuh"

#include <cub/block/block_reduce.cuh>

#include <cfloat>

namespace shardopt_kernels {
namespace {

constexpr int kMaxBlocks = 1024;  // stage 1's grid at most: the workspace holds one partial per block
constexpr int kUnroll = 4;        // packs each thread loads before it accumulates them

// A share of the norm: the sum of squares or the max |x|, and whether an element was inf or NaN.
struct alignas(16) Partial {
  double value;
  int nonfinite;
};

template <shardopt_norm_kind kKind>
struct Combine {
  __device__ __forceinline__ Partial operator()(const Partial& a, const Partial& b) const {
    if constexpr (kKind == SHARDOPT_NORM_L2_SQUARED) {
      return {a.value + b.value, a.nonfinite | b.nonfinite};
    } else {
      return {fmax(a.value, b.value), a.nonfinite | b.nonfinite};
    }
  }
};

// One element into a thread's share. Squares in double: no overflow, no small terms lost. fmax
// returns the other operand for a NaN, so NaN stays out of the inf norm and only sets the flag.
template <shardopt_norm_kind kKind>
__device__ __forceinline__ void accumulate(Partial& acc, float x) {
  acc.nonfinite |= !(fabsf(x) <= FLT_MAX);
  if constexpr (kKind == SHARDOPT_NORM_L2_SQUARED) {
    acc.value = fma(static_cast<double>(x), static_cast<double>(x), acc.value);
  } else {
    acc.value = fmax(acc.value, static_cast<double>(fabsf(x)));
  }
}

// Chunk `chunk` of a segment's aligned body: kUnroll rounds of kThreads consecutive packs, all
// loaded before any is accumulated.
template <shardopt_norm_kind kKind, int N, class T>
__device__ __forceinline__ void accumulate_chunk(Partial& acc, const T* body, int64_t packs, int64_t chunk) {
  const int64_t first = chunk * (static_cast<int64_t>(kThreads) * kUnroll) + threadIdx.x;
  Pack<T, N> x[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (first + u * kThreads < packs) x[u] = load_readonly<N>(body + (first + u * kThreads) * N);
  }
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    if (first + u * kThreads < packs) {
#pragma unroll
      for (int k = 0; k < N; ++k) accumulate<kKind>(acc, to_float(x[u].v[k]));
    }
  }
}

// Stage 1. Segment s's body, from its first 16-byte boundary on, splits into chunks; chunk c goes
// to block (s + c) mod gridDim.x, so that many small segments spread over the blocks as one large
// segment does. The unaligned head and the tail (fewer than two packs together) go to the block of
// chunk 0, one element per thread.
template <class T, shardopt_norm_kind kKind>
__global__ void __launch_bounds__(kThreads)
    norm_partials_kernel(const shardopt_norm_segment* __restrict__ segments, int64_t num_segments,
                         Partial* __restrict__ partials) {
  constexpr int N = kVectorBytes / sizeof(T);
  constexpr int64_t kChunkPacks = static_cast<int64_t>(kThreads) * kUnroll;
  const int blocks = static_cast<int>(gridDim.x);
  const int block = static_cast<int>(blockIdx.x);
  Partial acc{0.0, 0};
  int owner = 0;  // the block of the segment's chunk 0: s mod gridDim.x
  for (int64_t s = 0; s < num_segments; ++s) {
    const shardopt_norm_segment segment = segments[s];
    const T* data = static_cast<const T*>(segment.data);
    const int64_t count = segment.count > 0 ? segment.count : 0;
    const int64_t to_boundary =
        static_cast<int64_t>((kVectorBytes - reinterpret_cast<uintptr_t>(data) % kVectorBytes) % kVectorBytes / sizeof(T));
    const int64_t head = to_boundary < count ? to_boundary : count;
    const int64_t packs = (count - head) / N;
    const int64_t chunks = (packs + kChunkPacks - 1) / kChunkPacks;
    for (int64_t c = block >= owner ? block - owner : block - owner + blocks; c < chunks; c += blocks) {
      accumulate_chunk<kKind, N>(acc, data + head, packs, c);
    }
    if (block == owner) {
      const int64_t singles = count - packs * N;
      if (threadIdx.x < singles) {
        const int64_t t = threadIdx.x;
        accumulate<kKind>(acc, to_float(__ldg(data + (t < head ? t : head + packs * N + (t - head)))));
      }
    }
    owner = owner + 1 == blocks ? 0 : owner + 1;
  }
  using BlockReduce = cub::BlockReduce<Partial, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  const Partial total = BlockReduce(temp).Reduce(acc, Combine<kKind>{});
  if (threadIdx.x == 0) partials[block] = total;
}

// Stage 2: one block folds the partials (thread t takes t, t + kThreads, ...) and reduces the folds.
template <shardopt_norm_kind kKind>
__global__ void __launch_bounds__(kThreads)
    norm_finish_kernel(const Partial* __restrict__ partials, int count, float* __restrict__ result,
                       float* __restrict__ found_inf) {
  Partial acc{0.0, 0};
  for (int i = threadIdx.x; i < count; i += kThreads) acc = Combine<kKind>{}(acc, partials[i]);
  using BlockReduce = cub::BlockReduce<Partial, kThreads>;
  __shared__ typename BlockReduce::TempStorage temp;
  const Partial total = BlockReduce(temp).Reduce(acc, Combine<kKind>{});
  if (threadIdx.x == 0) {
    *result = __double2float_rn(total.value);
    *found_inf = total.nonfinite != 0 ? 1.0f : 0.0f;
  }
}

template <class T, shardopt_norm_kind kKind>
shardopt_kernel_status launch(const shardopt_norm_segment* segments, int64_t num_segments, Partial* partials,
                              float* result, float* found_inf, cudaStream_t stream) {
  auto* partials_kernel = norm_partials_kernel<T, kKind>;
  int blocks = 0;
  SHARDOPT_CUDA_TRY(blocks_for(partials_kernel, static_cast<int64_t>(kMaxBlocks) * kThreads, &blocks));
  partials_kernel<<<blocks, kThreads, 0, stream>>>(segments, num_segments, partials);
  SHARDOPT_CUDA_TRY(cudaGetLastError());
  norm_finish_kernel<kKind><<<1, kThreads, 0, stream>>>(partials, blocks, result, found_inf);
  SHARDOPT_CUDA_TRY(cudaGetLastError());
  return SHARDOPT_KERNEL_OK;
}

template <class T>
shardopt_kernel_status launch_kind(shardopt_norm_kind kind, const shardopt_norm_segment* segments,
                                   int64_t num_segments, Partial* partials, float* result, float* found_inf,
                                   cudaStream_t stream) {
  switch (kind) {
    case SHARDOPT_NORM_L2_SQUARED:
      return launch<T, SHARDOPT_NORM_L2_SQUARED>(segments, num_segments, partials, result, found_inf, stream);
    case SHARDOPT_NORM_INF:
      return launch<T, SHARDOPT_NORM_INF>(segments, num_segments, partials, result, found_inf, stream);
  }
  return SHARDOPT_KERNEL_INVALID_ARGUMENT;
}

constexpr size_t kWorkspaceBytes = kMaxBlocks * sizeof(Partial);

}  // namespace
}  // namespace shardopt_kernels

using namespace shardopt_kernels;

extern "C" shardopt_kernel_status shardopt_norm_workspace_bytes(size_t* bytes) {
  if (bytes == nullptr) return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  *bytes = kWorkspaceBytes;
  return SHARDOPT_KERNEL_OK;
}

extern "C" shardopt_kernel_status shardopt_norm(const shardopt_norm_segment* segments, int64_t num_segments,
                                                shardopt_kernel_dtype dtype, shardopt_norm_kind kind, void* workspace,
                                                size_t workspace_bytes, float* result, float* found_inf,
                                                cudaStream_t stream) {
  const bool usable_arguments =
      num_segments >= 0 && (num_segments == 0 || usable(segments, alignof(shardopt_norm_segment))) &&
      usable(workspace, alignof(Partial)) && workspace_bytes >= kWorkspaceBytes && usable(result, 4) &&
      usable(found_inf, 4);
  if (!usable_arguments ||
      !disjoint({bytes_of(segments, num_segments, sizeof(shardopt_norm_segment)),
                 bytes_of(workspace, 1, kWorkspaceBytes), bytes_of(result, 1, 4), bytes_of(found_inf, 1, 4)})) {
    return SHARDOPT_KERNEL_INVALID_ARGUMENT;
  }
  Partial* partials = static_cast<Partial*>(workspace);
  switch (dtype) {
    case SHARDOPT_KERNEL_FLOAT32:
      return launch_kind<float>(kind, segments, num_segments, partials, result, found_inf, stream);
    case SHARDOPT_KERNEL_BFLOAT16:
      return launch_kind<__nv_bfloat16>(kind, segments, num_segments, partials, result, found_inf, stream);
    case SHARDOPT_KERNEL_FLOAT16:
      return launch_kind<__half>(kind, segments, num_segments, partials, result, found_inf, stream);
  }
  return SHARDOPT_KERNEL_INVALID_ARGUMENT;
}
