// The compressed wires' loops for any x86-64 CPU, and the choice of the build this CPU runs.
#define SHARDOPT_WIRE_NS wire_default
#include "comm/wire_kernels.inc"

#include "optim/fused_kernels.h"

namespace shardopt::detail {

void int8_encode(const float* x, int64_t n, int64_t begin, int64_t end, uint8_t* packed, float* rounded) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::int8_encode(x, n, begin, end, packed, rounded);
    case 1: return wire_avx2::int8_encode(x, n, begin, end, packed, rounded);
    default: return wire_default::int8_encode(x, n, begin, end, packed, rounded);
  }
}

void int8_decode(const uint8_t* packed, int64_t n, int64_t begin, int64_t end, float* out) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::int8_decode(packed, n, begin, end, out);
    case 1: return wire_avx2::int8_decode(packed, n, begin, end, out);
    default: return wire_default::int8_decode(packed, n, begin, end, out);
  }
}

void int8_feed_back(float* x, uint16_t* residual, int64_t n, int64_t begin, int64_t end) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::int8_feed_back(x, residual, n, begin, end);
    case 1: return wire_avx2::int8_feed_back(x, residual, n, begin, end);
    default: return wire_default::int8_feed_back(x, residual, n, begin, end);
  }
}

void bf16_encode(const float* x, int64_t begin, int64_t end, uint16_t* packed, float* rounded) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::bf16_encode(x, begin, end, packed, rounded);
    case 1: return wire_avx2::bf16_encode(x, begin, end, packed, rounded);
    default: return wire_default::bf16_encode(x, begin, end, packed, rounded);
  }
}

void bf16_decode(const uint16_t* packed, int64_t begin, int64_t end, float* out) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::bf16_decode(packed, begin, end, out);
    case 1: return wire_avx2::bf16_decode(packed, begin, end, out);
    default: return wire_default::bf16_decode(packed, begin, end, out);
  }
}

void bf16_sum(const float* own, const uint16_t* const* incoming, size_t count, int64_t begin, int64_t end,
              int64_t numel, float divisor, float* out) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::bf16_sum(own, incoming, count, begin, end, numel, divisor, out);
    case 1: return wire_avx2::bf16_sum(own, incoming, count, begin, end, numel, divisor, out);
    default: return wire_default::bf16_sum(own, incoming, count, begin, end, numel, divisor, out);
  }
}

void int8_sum(const float* own, const uint8_t* const* incoming, size_t count, int64_t n, int64_t begin, int64_t end,
              int64_t numel, float divisor, float* out) {
  switch (cpu_kernel_level()) {
    case 2: return wire_avx512::int8_sum(own, incoming, count, n, begin, end, numel, divisor, out);
    case 1: return wire_avx2::int8_sum(own, incoming, count, n, begin, end, numel, divisor, out);
    default: return wire_default::int8_sum(own, incoming, count, n, begin, end, numel, divisor, out);
  }
}

}  // namespace shardopt::detail
