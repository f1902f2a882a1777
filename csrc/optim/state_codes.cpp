#include "optim/state_codes.h"

#include <shardopt/check.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
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

float quantise_block(const float* values, int64_t n, const float* map, uint8_t* codes) {
  float absmax = 0.0f;
  for (int64_t i = 0; i < n; ++i) absmax = absmax_step(absmax, std::fabs(values[i]));
  const float scale = std::max(absmax, 1e-12f);
  for (int64_t i = 0; i < n; ++i) {
    const float x = values[i] / scale;
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
    codes[i] = static_cast<uint8_t>(c);
  }
  return scale;
}

void dequantise_block(const uint8_t* codes, int64_t n, float scale, const float* map, float* values) {
  for (int64_t i = 0; i < n; ++i) values[i] = map[codes[i]] * scale;
}

std::pair<at::Tensor, at::Tensor> quantise(const at::Tensor& values, bool is_signed) {
  SHARDOPT_CHECK(values.scalar_type() == at::kFloat && values.device().is_cpu(),
                 "8-bit state codes fp32 CPU tensors, got ", values.scalar_type(), " on ", values.device());
  const at::Tensor v = values.contiguous();
  const int64_t n = v.numel();
  at::Tensor codes = at::empty(v.sizes(), v.options().dtype(at::kByte));
  at::Tensor scales = at::empty({state_blocks(n)}, v.options());
  const float* map = dynamic_map(is_signed).data();
  const float* in = v.data_ptr<float>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  float* s = scales.data_ptr<float>();
  for (int64_t b = 0; b * kStateBlock < n; ++b) {
    const int64_t begin = b * kStateBlock;
    s[b] = quantise_block(in + begin, std::min(kStateBlock, n - begin), map, out + begin);
  }
  return {codes, scales};
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

}  // namespace shardopt::detail
