// bf16 as bit patterns, for loops over host memory that the compiler vectorises (the wires'
// rounding and error feedback). Internal.
//
// Internal linkage on purpose: the wires' loops are compiled once per instruction set
// (wire_kernels.inc), and an inline function with external linkage could be taken by the linker
// from a file built for an instruction set this CPU lacks.
#pragma once

#include <cstdint>
#include <cstring>

namespace shardopt::detail {
namespace {

// To bf16, to nearest with ties to even (a NaN stays a NaN): c10::BFloat16's rounding.
inline uint16_t to_bf16_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return nan ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

inline float from_bf16_bits(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

}  // namespace
}  // namespace shardopt::detail
