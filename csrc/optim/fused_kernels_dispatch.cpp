// The fused step's narrow-state loops and block coders in the widest build this CPU runs
// (cpu_kernel_level(); fused_kernels.h).
#include "optim/fused_kernels.h"

namespace shardopt {

void detail::adam8_step(const Adam8Segment* segments, size_t count, const AdamScalars& s) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::adam8(segments, count, s);
    case 1: return kernels_avx2::adam8(segments, count, s);
    default: return kernels_default::adam8(segments, count, s);
  }
}

void detail::sgd8_step(const Sgd8Segment* segments, size_t count, const SgdScalars& s) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::sgd8(segments, count, s);
    case 1: return kernels_avx2::sgd8(segments, count, s);
    default: return kernels_default::sgd8(segments, count, s);
  }
}

void detail::adam16_step(const Adam16Segment* segments, size_t count, const AdamScalars& s) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::adam16(segments, count, s);
    case 1: return kernels_avx2::adam16(segments, count, s);
    default: return kernels_default::adam16(segments, count, s);
  }
}

void detail::sgd16_step(const Sgd16Segment* segments, size_t count, const SgdScalars& s) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::sgd16(segments, count, s);
    case 1: return kernels_avx2::sgd16(segments, count, s);
    default: return kernels_default::sgd16(segments, count, s);
  }
}

void detail::code_block_fast(const float* values, int64_t n, float scale, const float* map, uint8_t* codes) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::code_block(values, n, scale, map, codes);
    case 1: return kernels_avx2::code_block(values, n, scale, map, codes);
    default: return kernels_default::code_block(values, n, scale, map, codes);
  }
}

void detail::decode_block_fast(const uint8_t* codes, int64_t n, float scale, const float* map, float* values) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::decode_block(codes, n, scale, map, values);
    case 1: return kernels_avx2::decode_block(codes, n, scale, map, values);
    default: return kernels_default::decode_block(codes, n, scale, map, values);
  }
}

float detail::quantise_block_fast(const float* values, int64_t n, const float* map, uint8_t* codes) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::quantise_block(values, n, map, codes);
    case 1: return kernels_avx2::quantise_block(values, n, map, codes);
    default: return kernels_default::quantise_block(values, n, map, codes);
  }
}

}  // namespace shardopt
