// The compressed wires' loops on the CPU, the int8 wire's over blocks (Note [Int8 wire] in
// wire.cpp) and the bf16 wire's casts and sums, built for any x86-64 CPU, for AVX2 and for
// AVX-512, and chosen at run time as the fused step's are (cpu_kernel_level()).
// Every build gives the same bits: a maximum, a division, a rounding by adding and subtracting
// 1.5 * 2^23 and products summed one at a time are exactly rounded whatever the vector width, and
// no build has fused multiply-adds. Internal.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shardopt::detail {

// Over blocks [begin, end) of n elements (the packed layout of Note [Int8 wire]: n int8 values,
// then one fp32 scale per block):
// - int8_encode: x's blocks quantised into `packed`, and, with `rounded` (which may be x),
//   dequantised into it in the same pass: int8_decode's bits;
// - int8_decode: `packed`'s blocks dequantised into `out`;
// - int8_sum: out = decode(encode(own)) + decode(incoming[0]) + ..., each product rounded then
//   added in that order, out[i] divided by `divisor` where i < numel;
// - int8_feed_back: error feedback in one pass (Note [Error feedback] in csrc/ddp/reduction.cpp):
//   v = x + residual (bf16 bits widened), x = decode(encode(v)), residual = v - x rounded to bf16
//   (to nearest, ties to even), the bits of ATen's add_, round trip, sub_ and copies.
// And the bf16 wire's loops, over elements [begin, end):
// - bf16_encode: x rounded to bf16 (to nearest, ties to even: ATen's bits) into `packed`, and,
//   with `rounded` (which may be x), widened back into it in the same pass;
// - bf16_decode: `packed` widened into `out`;
// - bf16_sum: out = widen(round(own)) + widen(incoming[0]) + ..., each addition rounded to fp32
//   in that order, out[i] divided by `divisor` where i < numel (own may be out).
#define SHARDOPT_WIRE_KERNELS(ns)                                                                                 \
  namespace ns {                                                                                                  \
  void bf16_encode(const float* x, int64_t begin, int64_t end, uint16_t* packed, float* rounded);                 \
  void bf16_decode(const uint16_t* packed, int64_t begin, int64_t end, float* out);                               \
  void bf16_sum(const float* own, const uint16_t* const* incoming, size_t count, int64_t begin, int64_t end,      \
                int64_t numel, float divisor, float* out);                                                        \
  void int8_feed_back(float* x, uint16_t* residual, int64_t n, int64_t begin, int64_t end);                       \
  void int8_encode(const float* x, int64_t n, int64_t begin, int64_t end, uint8_t* packed, float* rounded);       \
  void int8_decode(const uint8_t* packed, int64_t n, int64_t begin, int64_t end, float* out);                     \
  void int8_sum(const float* own, const uint8_t* const* incoming, size_t count, int64_t n, int64_t begin,         \
                int64_t end, int64_t numel, float divisor, float* out);                                           \
  }
SHARDOPT_WIRE_KERNELS(wire_default)
SHARDOPT_WIRE_KERNELS(wire_avx2)
SHARDOPT_WIRE_KERNELS(wire_avx512)
#undef SHARDOPT_WIRE_KERNELS

// The build this CPU runs (kernels_default, _avx2 or _avx512 by cpu_kernel_level()), then the call.
void int8_encode(const float* x, int64_t n, int64_t begin, int64_t end, uint8_t* packed, float* rounded);
void int8_decode(const uint8_t* packed, int64_t n, int64_t begin, int64_t end, float* out);
void int8_feed_back(float* x, uint16_t* residual, int64_t n, int64_t begin, int64_t end);
void bf16_encode(const float* x, int64_t begin, int64_t end, uint16_t* packed, float* rounded);
void bf16_decode(const uint16_t* packed, int64_t begin, int64_t end, float* out);
void bf16_sum(const float* own, const uint16_t* const* incoming, size_t count, int64_t begin, int64_t end,
              int64_t numel, float divisor, float* out);
void int8_sum(const float* own, const uint8_t* const* incoming, size_t count, int64_t n, int64_t begin, int64_t end,
              int64_t numel, float divisor, float* out);

}  // namespace shardopt::detail
