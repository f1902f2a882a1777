// The compressed wires' loops for any x86-64 CPU, and the choice of the build this CPU runs.
#define SHARDOPT_WIRE_NS wire_default
#include "comm/wire_kernels.inc"

#include "optim/fused_kernels.h"

namespace shardopt::detail {

namespace {

// The build of one loop that this CPU runs.
template <typename F>
F* chosen(F* avx512, F* avx2, F* baseline) {
  switch (cpu_kernel_level()) {
    case 2: return avx512;
    case 1: return avx2;
    default: return baseline;
  }
}

}  // namespace

#define SHARDOPT_CHOSEN(fn) chosen(wire_avx512::fn, wire_avx2::fn, wire_default::fn)

void int8_encode(const float* x, int64_t n, int64_t begin, int64_t end, uint8_t* packed, float* rounded) {
  SHARDOPT_CHOSEN(int8_encode)(x, n, begin, end, packed, rounded);
}

void int8_decode(const uint8_t* packed, int64_t n, int64_t begin, int64_t end, float* out) {
  SHARDOPT_CHOSEN(int8_decode)(packed, n, begin, end, out);
}

void int8_feed_back(float* x, uint16_t* residual, int64_t n, int64_t begin, int64_t end) {
  SHARDOPT_CHOSEN(int8_feed_back)(x, residual, n, begin, end);
}

void bf16_encode(const float* x, int64_t begin, int64_t end, uint16_t* packed, float* rounded) {
  SHARDOPT_CHOSEN(bf16_encode)(x, begin, end, packed, rounded);
}

void bf16_decode(const uint16_t* packed, int64_t begin, int64_t end, float* out) {
  SHARDOPT_CHOSEN(bf16_decode)(packed, begin, end, out);
}

void bf16_sum(const float* own, const uint16_t* const* incoming, size_t count, int64_t begin, int64_t end,
              int64_t numel, float divisor, float* out) {
  SHARDOPT_CHOSEN(bf16_sum)(own, incoming, count, begin, end, numel, divisor, out);
}

void int8_sum(const float* own, const uint8_t* const* incoming, size_t count, int64_t n, int64_t begin, int64_t end,
              int64_t numel, float divisor, float* out) {
  SHARDOPT_CHOSEN(int8_sum)(own, incoming, count, n, begin, end, numel, divisor, out);
}

#undef SHARDOPT_CHOSEN

}  // namespace shardopt::detail
