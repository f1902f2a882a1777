// What the kernels of kernels/src share: packs of elements moved as 16-byte vectors, conversions
// between the element types, how a segment splits into vectors, grid sizing, argument checks
// and the one CUDA status check. Internal to kernels/src.
#pragma once

#include <shardopt_kernels/status.h>
#include <shardopt_kernels/types.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>

namespace shardopt_kernels {

constexpr int kThreads = 256;     // threads per block of every kernel
constexpr int kVectorBytes = 16;  // the widest access of one thread: LDG.128 / STG.128

// Records `error` for shardopt_kernel_last_cuda_error() and returns SHARDOPT_KERNEL_CUDA_ERROR.
shardopt_kernel_status cuda_failure(cudaError_t error);

// The status check of every CUDA runtime call in an entry point.
#define SHARDOPT_CUDA_TRY(call)                                                    \
  do {                                                                             \
    const cudaError_t shardopt_cuda_error_ = (call);                               \
    if (shardopt_cuda_error_ != cudaSuccess) {                                     \
      return ::shardopt_kernels::cuda_failure(shardopt_cuda_error_);               \
    }                                                                              \
  } while (0)

// ---- packs ------------------------------------------------------------------------------------

// N consecutive elements, aligned for 16-byte accesses once they span 16 bytes (a pack of eight
// floats moves as two 16-byte accesses; a pack of one element as one element).
template <class T, int N>
struct alignas(sizeof(T) * N < kVectorBytes ? sizeof(T) * N : kVectorBytes) Pack {
  T v[N];
};

template <int N, class T>
__device__ __forceinline__ Pack<T, N> load(const T* p) {
  return *reinterpret_cast<const Pack<T, N>*>(p);
}

template <int N, class T>
__device__ __forceinline__ void store(T* p, const Pack<T, N>& x) {
  if constexpr (sizeof(T) == 2 && sizeof(Pack<T, N>) % kVectorBytes == 0) {
    // Two-byte elements go out as explicit 16-byte stores (__stwb: st.global.wb.v4.u32): as an
    // aggregate copy, nvcc emitted one 2-byte store per element in the list kernel of adamw.cu,
    // where it vectorized the fp32 packs.
#pragma unroll
    for (int q = 0; q < static_cast<int>(sizeof(Pack<T, N>) / kVectorBytes); ++q) {
      uint4 bits;
      memcpy(&bits, reinterpret_cast<const unsigned char*>(&x) + q * kVectorBytes, kVectorBytes);
      __stwb(reinterpret_cast<uint4*>(p) + q, bits);
    }
  } else {
    *reinterpret_cast<Pack<T, N>*>(p) = x;
  }
}

// The same through the read-only data path (ld.global.nc), for buffers that no thread writes while
// the kernel runs; it also tells the compiler the address is global where it cannot see that itself
// (a pointer read from a descriptor in memory).
template <int N, class T>
__device__ __forceinline__ Pack<T, N> load_readonly(const T* p) {
  Pack<T, N> x;
  if constexpr (N == 1) {
    x.v[0] = __ldg(p);
  } else {
    static_assert(sizeof(Pack<T, N>) % kVectorBytes == 0, "a pack of several elements spans whole vectors");
#pragma unroll
    for (int q = 0; q < static_cast<int>(sizeof(Pack<T, N>) / kVectorBytes); ++q) {
      const uint4 bits = __ldg(reinterpret_cast<const uint4*>(p) + q);
      memcpy(reinterpret_cast<unsigned char*>(&x) + q * kVectorBytes, &bits, kVectorBytes);
    }
  }
  return x;
}

// Exact conversions to fp32.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// fp32 to T, rounded to nearest even (overflow to inf, NaN kept).
template <class T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}

template <class T, int N>
__device__ __forceinline__ Pack<T, N> round_pack(const Pack<float, N>& x) {
  Pack<T, N> out;
#pragma unroll
  for (int k = 0; k < N; ++k) out.v[k] = from_float<T>(x.v[k]);
  return out;
}

// ---- splitting a segment into vectors -----------------------------------------------------------

// Elements [0, head) one by one, then `vectors` packs of the kernel's width from `head` on, then
// the remaining elements one by one. Split{} (no vectors) processes everything element by element.
struct Split {
  int64_t head = 0;
  int64_t vectors = 0;
};

// One buffer of a segment; a null address (an optional buffer that is absent) takes no part.
struct Buffer {
  const void* address;
  size_t element_bytes;
};

// The split whose packs of `width` elements start every buffer on a 16-byte boundary: the
// smallest head below `width` at which all addresses are 16-byte aligned, or no vectors when no
// head is. `width` is 16 bytes over the smallest element size, so a pack spans a multiple of 16
// bytes in every buffer and each pack after the first stays aligned.
inline Split split_for_vectors(int64_t n, int width, std::initializer_list<Buffer> buffers) {
  for (int64_t head = 0; head < width && head < n; ++head) {
    bool aligned = true;
    for (const Buffer& b : buffers) {
      const uintptr_t at = reinterpret_cast<uintptr_t>(b.address) + static_cast<uintptr_t>(head) * b.element_bytes;
      aligned = aligned && (b.address == nullptr || at % kVectorBytes == 0);
    }
    if (aligned) return Split{head, (n - head) / width};
  }
  return Split{};
}

// Calls apply(std::integral_constant<int, Width>{}, i) for the pack at element i of each of the
// split's vectors, then apply(std::integral_constant<int, 1>{}, i) for each element outside
// them: a grid-stride loop over each, with 64-bit indices.
template <int Width, class Apply>
__device__ __forceinline__ void for_each_pack(int64_t n, Split split, const Apply& apply) {
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t j = first; j < split.vectors; j += stride) {
    apply(std::integral_constant<int, Width>{}, split.head + j * Width);
  }
  const int64_t body_end = split.head + split.vectors * Width;
  const int64_t singles = n - split.vectors * Width;
  for (int64_t j = first; j < singles; j += stride) {
    apply(std::integral_constant<int, 1>{}, j < split.head ? j : body_end + (j - split.head));
  }
}

// ---- launching ------------------------------------------------------------------------------------

// Blocks of kThreads for `items` work items (one per thread and loop trip): enough to cover them,
// and at most as many as the current device keeps resident at once (the loops stride over the rest).
template <class Kernel>
cudaError_t blocks_for(Kernel* kernel, int64_t items, int* blocks) {
  int device = 0, multiprocessors = 0, per_multiprocessor = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error == cudaSuccess) {
    error = cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  }
  if (error == cudaSuccess) {
    error = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, kThreads, 0);
  }
  if (error != cudaSuccess) return error;
  const int64_t resident = static_cast<int64_t>(multiprocessors) * std::max(per_multiprocessor, 1);
  const int64_t wanted = (items + kThreads - 1) / kThreads;
  *blocks = static_cast<int>(std::max<int64_t>(1, std::min(wanted, resident)));
  return cudaSuccess;
}

// ---- argument checks -----------------------------------------------------------------------------

inline size_t element_bytes(shardopt_kernel_dtype dtype) {
  switch (dtype) {
    case SHARDOPT_KERNEL_FLOAT32: return 4;
    case SHARDOPT_KERNEL_BFLOAT16:
    case SHARDOPT_KERNEL_FLOAT16: return 2;
  }
  return 0;
}

inline bool aligned_to(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// A buffer an entry point needs: present and aligned to its element size.
inline bool usable(const void* p, size_t element_bytes) { return p != nullptr && aligned_to(p, element_bytes); }

// A buffer an entry point may go without: absent, or aligned to its element size.
inline bool usable_if_given(const void* p, size_t element_bytes) { return p == nullptr || aligned_to(p, element_bytes); }

// A buffer's bytes [begin, end); empty ranges (absent buffers) overlap nothing.
struct ByteRange {
  uintptr_t begin;
  uintptr_t end;
};

inline ByteRange bytes_of(const void* p, int64_t count, size_t element_bytes) {
  const uintptr_t begin = reinterpret_cast<uintptr_t>(p);
  return {begin, p == nullptr ? begin : begin + static_cast<uintptr_t>(count) * element_bytes};
}

// Whether no two of the ranges share a byte.
inline bool disjoint(std::initializer_list<ByteRange> ranges) {
  for (auto a = ranges.begin(); a != ranges.end(); ++a) {
    for (auto b = a + 1; b != ranges.end(); ++b) {
      if (a->begin < b->end && b->begin < a->end) return false;
    }
  }
  return true;
}

// The same for many ranges (the buffers of a list of segments): sorted by start, each must end
// before the next begins. `ranges` is reordered.
inline bool disjoint_sorted(ByteRange* ranges, size_t count) {
  std::sort(ranges, ranges + count, [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  for (size_t k = 1; k < count; ++k) {
    if (ranges[k].begin < ranges[k - 1].end) return false;
  }
  return true;
}

// Calls f(TypeTag<CopyT>{}, TypeTag<GradT>{}) for the mixed-precision steps' pairs: a bf16 or fp16
// copy with gradients in the copy's dtype or fp32. Any other pair is an invalid argument.
template <class T>
struct TypeTag {
  using type = T;
};

template <class F>
shardopt_kernel_status dispatch_mixed(shardopt_kernel_dtype copy, shardopt_kernel_dtype grad, const F& f) {
  if (copy == SHARDOPT_KERNEL_BFLOAT16 && grad == SHARDOPT_KERNEL_BFLOAT16) {
    return f(TypeTag<__nv_bfloat16>{}, TypeTag<__nv_bfloat16>{});
  }
  if (copy == SHARDOPT_KERNEL_BFLOAT16 && grad == SHARDOPT_KERNEL_FLOAT32) return f(TypeTag<__nv_bfloat16>{}, TypeTag<float>{});
  if (copy == SHARDOPT_KERNEL_FLOAT16 && grad == SHARDOPT_KERNEL_FLOAT16) return f(TypeTag<__half>{}, TypeTag<__half>{});
  if (copy == SHARDOPT_KERNEL_FLOAT16 && grad == SHARDOPT_KERNEL_FLOAT32) return f(TypeTag<__half>{}, TypeTag<float>{});
  return SHARDOPT_KERNEL_INVALID_ARGUMENT;
}

}  // namespace shardopt_kernels
