// 8-bit optimizer state: blockwise codes from the dynamic maps (Note [8-bit state] in
// state_codes.cpp). Internal to csrc/optim: the fused step's 8-bit loops (fused_kernels.h) and
// whatever turns codes into fp32 values and back (consolidation, loading) use these.
#pragma once

#include <shardopt/optim/oss.h>

#include <ATen/core/Tensor.h>

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>

namespace shardopt::detail {

using GenericDict = c10::impl::GenericDict;

// Elements per block; each block has one fp32 scale (its absolute maximum).
inline constexpr int64_t kStateBlock = kInt8StateBlock;
// Tensors with fewer elements keep fp32 state.
inline constexpr int64_t kMinCodedNumel = kInt8StateMinNumel;

// Whether a tensor of `numel` elements keeps its moments in codes: decided on the whole tensor,
// never on a shard of it.
inline bool coded_numel(int64_t numel) { return numel >= kMinCodedNumel; }
// The blocks of a tensor of `numel` elements (the last one may be short).
inline int64_t state_blocks(int64_t numel) { return (numel + kStateBlock - 1) / kStateBlock; }

// The dynamic map (bitsandbytes' create_dynamic_map, 7 exponent bits, as torchao 0.18 builds it):
// 256 values in ascending order, in [-1, 1] signed (first moments, momentum) or [0, 1] unsigned
// (second moments).
const std::array<float, 256>& dynamic_map(bool is_signed);

// One block: `n` (at most kStateBlock) values to codes, each the map's nearest value to value /
// scale, where scale is the block's absolute maximum (at least 1e-12; NaN when a value is NaN, as
// torch's amax); returns the scale. (The fused step's builds have vector versions with the same
// bits: fused_kernels.h.)
float quantise_block(const float* values, int64_t n, const float* map, uint8_t* codes);
// The absolute maximum's running step: NaN, once seen, stays.
inline float absmax_step(float absmax, float a) { return (a > absmax || a != a) && absmax == absmax ? a : absmax; }
// The code of x (a value already divided by its block's scale) as quantise_block finds it, by
// table (Note [Codes by table] in state_codes.cpp): the top 16 bits of x (its sign, its exponent
// and the top 7 bits of its mantissa), less those of 2^kTableMinExponent-127 and at least 0 (every
// smaller positive magnitude has the code of 0), pick a cell; the cell's code, plus one where x's
// low 16 mantissa bits reach the cell's threshold's, is the code. Built for the two dynamic maps.
inline constexpr int kTableMinExponent = 103;  // 2^-24, below the maps' smallest boundary but 0's
inline constexpr int kTableMantissaBits = 7;
inline constexpr int kTableLowBits = 23 - kTableMantissaBits;
inline constexpr int kTableFirstCell = kTableMinExponent << kTableMantissaBits;  // x's top 16 bits there
inline constexpr int kTableCells = (1 << (32 - kTableLowBits)) - kTableFirstCell;
// A cell's entry: its code above bit kTableCodeShift, under it the key at and above which x takes
// the next code (1 << kTableLowBits: none). A key is x's low mantissa bits, reversed for negative
// x (a larger magnitude is a smaller value).
inline constexpr int kTableCodeShift = kTableLowBits + 1;
struct CodeTable {
  std::array<uint32_t, kTableCells> entry;
  std::array<float, kTableCells> threshold;  // the lowest value with the next code; +inf: none
};
// The table of `map` when it is one of the dynamic maps, else null.
const CodeTable* code_table(const float* map);
// One value's code as quantise_block finds it (the binary search), for x = value / scale.
int code_of(float x, const float* map);

// One block back: map[code] * scale.
void dequantise_block(const uint8_t* codes, int64_t n, float scale, const float* map, float* values);

// A whole contiguous fp32 tensor to codes (uint8, its shape) and scales (fp32, one per block from
// element 0), and back. CPU.
std::pair<at::Tensor, at::Tensor> quantise(const at::Tensor& values, bool is_signed);
at::Tensor dequantise(const at::Tensor& codes, const at::Tensor& scales, bool is_signed);
// In a shard (OSS::state_shard(): sharded checkpoints, Resilient's copies) an 8-bit state entry
// is its codes (uint8, shaped like the range) beside its block scales under the entry's name and
// this suffix ("exp_avg.scales": fp32, one per kStateBlock elements from the range's start).
inline constexpr const char* kScalesSuffix = ".scales";
// `state` (an encoded state of one range) with each 8-bit entry decoded to fp32 values and its
// scales dropped. Throws, naming `what` and the entry, when codes and scales do not fit: codes
// not uint8, a number of scales other than one per block, a scale that is negative, NaN or
// infinite.
GenericDict decoded_state(const GenericDict& state, const std::string& what);

// quantise() for state that may be decoded codes coming back (Note [Codes of decoded codes]):
// each block takes the scale that decodes it exactly to its values where there is one, so that
// recode(dequantise(codes, scales)) gives those codes and scales; other values are coded as
// quantise() codes them.
std::pair<at::Tensor, at::Tensor> recode(const at::Tensor& values, bool is_signed);

}  // namespace shardopt::detail
