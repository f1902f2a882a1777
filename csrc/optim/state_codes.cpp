#include "optim/state_codes.h"

#include <shardopt/check.h>

#include "optim/codec.h"
#include "optim/fused_kernels.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

namespace shardopt::detail {

// Note [8-bit state]
// Each moment of a tensor of at least kMinCodedNumel elements is kept as one byte per element,
// in blocks of kStateBlock consecutive elements of the whole tensor, with one fp32 scale per
// block, the scheme of bitsandbytes' blockwise 8-bit optimizers and torchao's AdamW8bit
// (Dettmers et al., "8-bit Optimizers via Block-wise Quantization", arXiv 2110.02861):
//   - A block's scale is its absolute maximum (at least 1e-12); each value is divided by it and
//     coded as the nearest of 256 values of a dynamic map (ties go up), found by a branchless
//     binary search, as torchao's quantize_8bit_with_qmap does. Decoding is map[code] * scale.
//   - The dynamic map spends its codes on a dynamic exponent (1e-6 ... 1) and a fraction that
//     shrinks as the exponent grows: small moments keep relative precision. First moments (and
//     momentum) use the signed map, second moments the unsigned one, whose codes all go to [0, 1].
//   - A step decodes a block, updates it in fp32, steps the parameter with the new fp32 moments,
//     and only then codes them again (the update never sees its own rounding).
// Blocks are laid on the whole tensor, never on a shard of it: whether a tensor is coded and
// where its blocks start depend on its numel alone, so that a block's values, and so its scale,
// are the same whoever holds it, at every world size.

namespace {

std::array<float, 256> make_map(bool is_signed) {
  // As torchao.optim.quant_utils.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8),
  // with ATen's own linspace and float32 arithmetic, so that every value has the same bits.
  constexpr int kExponentBits = 7;
  static const double kPowers[kExponentBits] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<float> data;
  for (int i = 0; i < kExponentBits; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << i) + 1 : (int64_t{1} << (i + 1)) + 1;
    const at::Tensor bounds = at::linspace(0.1, 1, items, at::kFloat);
    const at::Tensor means = (bounds.slice(0, 0, items - 1) + bounds.slice(0, 1, items)) / 2.0;
    const at::Tensor up = (means * kPowers[i]).contiguous();
    data.insert(data.end(), up.data_ptr<float>(), up.data_ptr<float>() + up.numel());
    if (is_signed) {
      const at::Tensor down = (means * -kPowers[i]).contiguous();
      data.insert(data.end(), down.data_ptr<float>(), down.data_ptr<float>() + down.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  SHARDOPT_CHECK(data.size() == 256, "the dynamic map has ", data.size(), " values, not 256");
  std::sort(data.begin(), data.end());
  std::array<float, 256> map{};
  std::copy(data.begin(), data.end(), map.begin());
  return map;
}

}  // namespace

const std::array<float, 256>& dynamic_map(bool is_signed) {
  static const std::array<float, 256> kSigned = make_map(true);
  static const std::array<float, 256> kUnsigned = make_map(false);
  return is_signed ? kSigned : kUnsigned;
}

int code_of(float x, const float* map) {
  // The largest code whose value is at most x (0 below the map), then up when x is at least
  // halfway to the next value.
  int c = x >= map[128] ? 128 : 0;
  c += x >= map[c + 64] ? 64 : 0;
  c += x >= map[c + 32] ? 32 : 0;
  c += x >= map[c + 16] ? 16 : 0;
  c += x >= map[c + 8] ? 8 : 0;
  c += x >= map[c + 4] ? 4 : 0;
  c += x >= map[c + 2] ? 2 : 0;
  c += x >= map[c + 1] ? 1 : 0;
  const int up = std::min(c + 1, 255);
  const float down = map[c];
  if (x - down >= (map[up] - down) * 0.5f) c = up;
  return c;
}

float quantise_block(const float* values, int64_t n, const float* map, uint8_t* codes) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = absmax_step(absmax, std::fabs(values[i]));
  const float scale = std::max(absmax, 1e-12f);
  for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<uint8_t>(code_of(values[i] / scale, map));
  return scale;
}

// Note [Codes by table]
// quantise_block's code is a non-decreasing function of x (each comparison of the search, and the
// halfway rounding, is), so x's code is the number of the map's boundaries at or below x. Cut the
// floats into cells by their top 16 bits: sign, exponent and the top 7 bits of the mantissa (a
// magnitude range of 2^-7 of itself); the maps' values are at least 1.4% apart where they are
// densest against their own size, so a cell holds at most one boundary (checked as the table is
// built). Each cell keeps the code of its lowest value and the lowest value with the next code
// (+inf: none), found by bisection on the float order with the search itself, so the table gives
// the search's code for every float, not an approximation of it. The table starts at the cell of
// 2^-24: the maps' smallest boundary (halfway from 0 to their smallest nonzero value) is 1.6e-7,
// so every smaller positive magnitude has the code of 0 and takes that cell (checked as the table
// is built); every negative float, infinities and NaNs have cells of their own. (A NaN that a
// division gives is quiet, so it lies in a cell of NaNs alone, whose code is 0, as the search
// gives it; the cell of +inf holds only signalling NaNs beside it.) Within a cell x's order is that
// of its low 16 mantissa bits (reversed where x is negative), so the vector coders read one 32-bit
// entry a value, picked by x's top 16 bits less the first cell's, and compare integers: one gather.
// The cells a block's values take are those of its few decades below the scale: 25 KB covers the
// cells of 2^-24 to 1 of both signs, which the L1 cache holds.
namespace {

// The float at `order` in the floats' order as integers (non-decreasing in value; -0 and +0 alike).
float float_at(int64_t order) {
  const uint32_t bits = order < 0 ? static_cast<uint32_t>(-order) | 0x80000000u : static_cast<uint32_t>(order);
  float x;
  std::memcpy(&x, &bits, sizeof(x));
  return x;
}

std::unique_ptr<CodeTable> make_table(const float* map) {
  auto table = std::make_unique<CodeTable>();
  constexpr uint32_t kLow = (1u << kTableLowBits) - 1;
  for (int cell = 0; cell < kTableCells; ++cell) {
    const uint32_t top = static_cast<uint32_t>(cell + kTableFirstCell);  // the cell's 16 top bits
    const bool negative = (top >> 15) != 0;
    const uint32_t magnitude = (top & 0x7FFFu) << kTableLowBits;
    const bool special = (magnitude >> 23) == 0xFF;  // infinities and NaNs
    // The cell's magnitudes: [first, last] as bit patterns (the first cell reaches down to 0).
    const uint32_t first = cell == 0 ? 0u : magnitude, last = magnitude | kLow;
    int64_t lo = negative ? -static_cast<int64_t>(last) : first, hi = negative ? -static_cast<int64_t>(first) : last;
    // Infinities and NaNs: the code of the cell's first value (+-inf or a NaN), no threshold.
    const int c_lo = code_of(float_at(special ? (negative ? hi : lo) : lo), map);
    const int c_hi = special ? c_lo : code_of(float_at(hi), map);
    TORCH_INTERNAL_ASSERT(c_hi - c_lo >= 0 && c_hi - c_lo <= 1, "a code table cell holds ", c_hi - c_lo,
                          " boundaries");
    TORCH_INTERNAL_ASSERT(c_hi == c_lo || (cell > 0 && (magnitude >> 23) >= static_cast<uint32_t>(kTableMinExponent)),
                          "a code table cell at or below 2^-24 holds a boundary");
    table->threshold[cell] = std::numeric_limits<float>::infinity();
    uint32_t key = 1u << kTableLowBits;  // none
    if (c_hi != c_lo) {
      while (hi - lo > 1) {  // code(lo) == c_lo, code(hi) == c_hi
        const int64_t mid = lo + (hi - lo) / 2;
        (code_of(float_at(mid), map) == c_lo ? lo : hi) = mid;
      }
      table->threshold[cell] = float_at(hi);
      const uint32_t low = static_cast<uint32_t>(negative ? -hi : hi) & kLow;
      key = negative ? low ^ kLow : low;
    }
    table->entry[cell] = (static_cast<uint32_t>(c_lo) << kTableCodeShift) | key;
  }
  return table;
}

}  // namespace

const CodeTable* code_table(const float* map) {
  static const std::unique_ptr<CodeTable> kSigned = make_table(dynamic_map(true).data());
  static const std::unique_ptr<CodeTable> kUnsigned = make_table(dynamic_map(false).data());
  if (map == dynamic_map(true).data()) return kSigned.get();
  if (map == dynamic_map(false).data()) return kUnsigned.get();
  return nullptr;
}

void dequantise_block(const uint8_t* codes, int64_t n, float scale, const float* map, float* values) {
  for (int64_t i = 0; i < n; ++i) values[i] = map[codes[i]] * scale;
}

namespace {

// Each block of `values` (fp32, CPU) coded by code(block, n, map, codes) -> its scale.
template <class Coder>
std::pair<at::Tensor, at::Tensor> code_blocks(const at::Tensor& values, bool is_signed, const Coder& code) {
  SHARDOPT_CHECK(values.scalar_type() == at::kFloat && values.device().is_cpu(),
                 "8-bit state codes fp32 CPU tensors, got ", values.scalar_type(), " on ", values.device());
  const at::Tensor v = values.contiguous();
  const int64_t n = v.numel();
  at::Tensor codes = at::empty(v.sizes(), v.options().dtype(at::kByte));
  at::Tensor scales = at::empty({state_blocks(n)}, v.options());
  const float* map = dynamic_map(is_signed).data();
  for (int64_t b = 0; b * kStateBlock < n; ++b) {
    const int64_t begin = b * kStateBlock;
    scales.data_ptr<float>()[b] = code(v.data_ptr<float>() + begin, std::min(kStateBlock, n - begin), map,
                                       codes.data_ptr<uint8_t>() + begin);
  }
  return {codes, scales};
}

}  // namespace

std::pair<at::Tensor, at::Tensor> quantise(const at::Tensor& values, bool is_signed) {
  return code_blocks(values, is_signed, &quantise_block);
}

at::Tensor dequantise(const at::Tensor& codes, const at::Tensor& scales, bool is_signed) {
  SHARDOPT_CHECK(codes.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat &&
                     scales.numel() == state_blocks(codes.numel()),
                 "8-bit state needs uint8 codes and one fp32 scale per block of ", kStateBlock, ", got ",
                 codes.scalar_type(), " codes of ", codes.numel(), " elements and ", scales.numel(), " ",
                 scales.scalar_type(), " scales");
  const at::Tensor c = codes.contiguous();
  const at::Tensor s = scales.contiguous();
  const int64_t n = c.numel();
  at::Tensor values = at::empty(c.sizes(), s.options());
  const float* map = dynamic_map(is_signed).data();
  for (int64_t b = 0; b * kStateBlock < n; ++b) {
    const int64_t begin = b * kStateBlock;
    dequantise_block(c.data_ptr<uint8_t>() + begin, std::min(kStateBlock, n - begin), s.data_ptr<float>()[b], map,
                     values.data_ptr<float>() + begin);
  }
  return values;
}

// Note [Codes of decoded codes]
// A block's codes decode to map[code] * scale. Coding those values again gives the same codes, and
// the same scale when the block's largest magnitude decodes to the scale itself: a positive value,
// whose code is the map's 1. The signed map's most negative value is about -0.993, not -1, so a
// block whose largest magnitude was negative decodes to a largest magnitude of 0.993 of its scale,
// and quantise() would give it that smaller scale: moments that left a rank decoded (moved to
// another, consolidated, saved) would come back changed. recode() finds, per block, a scale that
// decodes the block's codes exactly to its values: the absolute maximum, else the absolute
// maximum divided by the magnitude of map[0], or a float within a few ulps of that (the division
// undoes the product's rounding up to that). Decoded values are exactly such products, so their
// own scale is found; for any other fp32 values no scale reproduces 256 values exactly, and the
// block takes its absolute maximum, as quantise() gives it.
namespace {

// Whether `scale` codes the block's values into codes that decode exactly to them; writes the codes
// (the fused step's vector coder: the same codes as code_of).
bool decodes_exactly(const float* values, int64_t n, float scale, const float* map, uint8_t* codes) {
  if (!(scale > 0) || !std::isfinite(scale)) return false;
  code_block_fast(values, n, scale, map, codes);
  bool exact = true;
  for (int64_t i = 0; i < n; ++i) exact &= map[codes[i]] * scale == values[i];
  return exact;
}

float recode_block(const float* values, int64_t n, const float* map, uint8_t* codes) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = absmax_step(absmax, std::fabs(values[i]));
  const float scale = std::max(absmax, 1e-12f);
  if (decodes_exactly(values, n, scale, map, codes)) return scale;
  if (map[0] < 0 && absmax > 0 && std::isfinite(absmax)) {
    float guess = absmax / std::fabs(map[0]);
    for (int k = 0; k < 4; ++k) guess = std::nextafter(guess, 0.0f);
    for (int k = 0; k < 9; ++k, guess = std::nextafter(guess, std::numeric_limits<float>::infinity())) {
      if (decodes_exactly(values, n, guess, map, codes)) return guess;
    }
  }
  return quantise_block(values, n, map, codes);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> recode(const at::Tensor& values, bool is_signed) {
  return code_blocks(values, is_signed, &recode_block);
}

GenericDict decoded_state(const GenericDict& state, const std::string& what) {
  const std::string suffix = kScalesSuffix;
  auto scales_key = [&](const std::string& key) { return key + suffix; };
  auto is_scales = [&](const std::string& key) {
    return key.size() > suffix.size() && key.compare(key.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  GenericDict out = make_string_dict();
  for (const auto& v : state) {
    const std::string& key = v.key().toStringRef();
    if (is_scales(key)) {
      const std::string codes_key = key.substr(0, key.size() - suffix.size());
      SHARDOPT_CHECK(state.contains(codes_key), what, ": 8-bit state scales '", key, "' without their codes '",
                     codes_key, "'");
      continue;
    }
    if (!v.value().isTensor() || !state.contains(scales_key(key))) {
      out.insert(v.key(), v.value());
      continue;
    }
    const at::Tensor codes = v.value().toTensor();
    const c10::IValue& s = state.at(scales_key(key));
    SHARDOPT_CHECK(s.isTensor(), what, ": the scales of 8-bit state '", key, "' are not a tensor");
    const at::Tensor scales = s.toTensor();
    SHARDOPT_CHECK(codes.scalar_type() == at::kByte, what, ": 8-bit state '", key, "' holds ", codes.scalar_type(),
                   " codes, not uint8");
    SHARDOPT_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() == state_blocks(codes.numel()),
                   what, ": 8-bit state '", key, "' has ", codes.numel(), " codes, which take ",
                   state_blocks(codes.numel()), " fp32 scales (one per ", kStateBlock, "), but holds ", scales.numel(),
                   " ", scales.scalar_type(), " (truncated or not 8-bit state?)");
    const at::Tensor bad = (scales.isfinite().logical_not() | (scales < 0)).nonzero();
    SHARDOPT_CHECK(bad.numel() == 0, what, ": 8-bit state '", key, "' has a scale of ",
                   bad.numel() ? scales[bad[0][0].item<int64_t>()].item<float>() : 0.0f, " at block ",
                   bad.numel() ? bad[0][0].item<int64_t>() : 0, " (a scale is a finite absolute maximum: corrupt state)");
    out.insert(v.key(), dequantise(codes.cpu(), scales.cpu(), signed_state(key)).to(codes.device()));
  }
  return out;
}

}  // namespace shardopt::detail
