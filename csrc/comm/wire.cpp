// Compressed wires (shardopt/comm/wire.h).
#include <shardopt/comm/wire.h>
#include <shardopt/check.h>

#include "comm/bf16_bits.h"
#include "comm/wire_kernels.h"
#include "comm/wire_codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace shardopt {

// Note [Gradient wire]
// ShardedDDPOptions::gradient_wire(kBFloat16) sends each rank's contribution to a bucket rounded
// to bf16 (half the bytes of fp32), as DDP's bf16_compress_hook and FSDP2's reduce_dtype do. What
// differs is where it is summed. On Gloo (direct transfers, Note [Rows] and Note [Reduce to one
// owner]) the owner widens every contribution it receives back to fp32 and sums them in fp32, in
// the order of the exact path (its own row first, then the others in rank order), its own
// contribution rounded to bf16 like the others', and divides after the sum: the result is the
// exact reduction of the bf16-rounded gradients, rounded once more only by the fp32 sum. On NCCL
// the reduce-scatter and reduce run in bf16 (NCCL sums in the wire's dtype), then the owner's row
// is widened to fp32 and divided. The stats count the bytes that travel (bf16). Under
// hierarchical sharding, on either compressed wire (bf16, int8), only the reduce-scatter within
// the block is compressed; the all-reduce of the owned row across blocks stays exact, so both
// replicas of a row receive the same bits (a compressed all-reduce would round partial sums on
// the way, differently on each rank of a ring), and the rounding happens once, on each rank's own
// contribution, as without blocks. That hop moves 1/B of the gradients per rank, so keeping it
// exact costs little (Hierarchical.CompressedGradientWiresCompressTheBlockHopOnly). Buckets
// already in bf16 or fp16 (MixedPrecision::reduce_dtype) travel as they are.

// Note [Parameter wire]
// OSSOptions::param_wire(kBFloat16) sends the parameter sync after the step in bf16. Quantisation
// error must not accumulate, so the owners step exact values: every rank keeps an fp32 master of
// the ranges it owns (the same machinery as mixed precision's masters, Note [Mixed precision]),
// the wrapped optimizer steps the master, and the owner writes it into its range of the
// parameters. The sync then rounds: each sender first rounds its own range in place (the row of
// an all-gather, the segment of a broadcast) to bf16 and widens it back, then sends the bf16
// bytes, and each receiver widens what arrives. (A row bucket's owner whose masters lie in its
// master slab rounds straight from there instead, in one pass with no write back: Note [Syncing
// from the masters] in csrc/optim/param_buffers.cpp.) Every rank, the owner included, ends with the
// master rounded to bf16 in its fp32 parameters, bit for bit; the next forward and backward run
// on those values, and the next step starts from the exact master again. The master is what
// state_dict(), state_shard() and checkpoints carry ("master_weights"), so a resumed run goes on
// from the exact values. Ranges the step did not change (a parameter without a gradient) are
// rounded by the sync like the others, so the copies stay equal. Only what travels is rounded:
// before the first step the parameters hold their initial values (rank 0's, as the masters), a
// parameter frozen from the start is never rounded, and at world size 1 nothing is. Under hierarchical sharding the sync runs within the block; every
// block's owners hold the same masters, so every block rounds to the same bits. Parameters already
// in bf16 (mixed precision's param_dtype) travel as they are; fp16 ones are refused with
// kBFloat16. The stats count the bytes that travel.

// Note [Int8 wire]
// Wire::kInt8 sends each contribution as int8 in blocks of kInt8Block (256) elements, one fp32
// scale per block, as ZeRO++'s qgZ and qwZ do: scale = max |x| / 127 over the block (1 for a
// block of zeros), q = round(x / scale) (half to even), and the receiver takes q * scale. A
// 256-element block costs 256 + 4 bytes: 0.254x the bytes of fp32. The error of one element is at
// most half a step, scale / 2, so a block's largest element sets the precision of all of it. A
// block holding inf or NaN arrives as NaN in every element, so the gradient scaler's found-inf
// check, which runs on the reduced gradients, sees the overflow.
// Gradients: every contribution, the owner's own too, is quantised and dequantised; the owner sums
// the dequantised rows in fp32 in the exact path's order (its own, then the others by rank) and
// divides after the sum, so the division by the world size follows the quantisation. A bf16 or
// fp16 bucket (mixed precision's reduce_dtype) is summed in fp32 too, and the mean rounded to the
// bucket's dtype once. The
// transfers are the direct sends of Note [Rows] (an all-to-all of quantised rows for a row
// bucket, each rank's row to its owner) and of Note [Reduce to one owner]; the stats count the
// packed bytes. Parameters: each owner quantises its range, sets its own parameters to the
// dequantised values and sends the packed bytes; every receiver dequantises, so every rank holds
// the same values (the owners step fp32 masters: Note [Parameter wire]). NCCL cannot sum int8
// blocks with their scales and has no direct transfers to build on: there the packed gradients
// travel in its all-to-all and gather (Note [Int8 wire on collectives] in on_wire.cpp).

namespace detail {

namespace {

bool cpu_float(const at::Tensor& t) { return t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat; }

bool cpu_bf16(const at::Tensor& t) { return t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kBFloat16; }

uint16_t* bf16_bits(const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

// Elements per task of the bf16 wire's casts on the CPU (bf16_encode, bf16_decode: one vectorised
// loop each, ATen's bits).
constexpr int64_t kBf16Grain = int64_t{1} << 14;

}  // namespace
}  // namespace detail

int64_t detail::WireCodec::packed_numel(int64_t numel) const {
  if (!int8()) return numel;
  const int64_t body = numel - tail_;
  return body + 4 * ((body + kInt8Block - 1) / kInt8Block) + 4 * tail_;
}

int64_t detail::WireCodec::packed_bytes(int64_t numel) const {
  return packed_numel(numel) * static_cast<int64_t>(c10::elementSize(packed_dtype()));
}

at::Tensor detail::WireCodec::encode(const at::Tensor& x) const {
  if (!int8() && !(wire_ == at::kBFloat16 && cpu_float(x))) return x.to(wire_);
  at::Tensor packed = int8() ? at::empty({packed_numel(x.numel())}, x.options().dtype(at::kByte))
                             : at::empty_like(x, x.options().dtype(at::kBFloat16));
  encode_into(x, packed);
  return packed;
}

void detail::WireCodec::encode_into(const at::Tensor& x, at::Tensor packed) const {
  SHARDOPT_CHECK(packed.numel() == packed_numel(x.numel()) && packed.scalar_type() == packed_dtype(),
                 "wire encode: ", packed.numel(), " packed elements of ", packed.scalar_type(), " for ", x.numel(),
                 " elements");
  if (wire_ == at::kBFloat16 && cpu_float(x) && cpu_bf16(packed)) {
    const float* src = x.const_data_ptr<float>();
    uint16_t* dst = bf16_bits(packed);
    at::parallel_for(0, x.numel(), kBf16Grain,
                     [&](int64_t begin, int64_t end) { bf16_encode(src, begin, end, dst, nullptr); });
    return;
  }
  if (!int8()) {
    packed.copy_(x);
    return;
  }
  SHARDOPT_CHECK(x.numel() >= tail_, "int8 wire: ", x.numel(), " elements with an exact tail of ", tail_);
  const int64_t n = x.numel() - tail_, blocks = (n + kInt8Block - 1) / kInt8Block;
  if (cpu_float(x) && packed.is_cpu() && packed.is_contiguous()) {  // one pass over each block, in cache
    const float* src = x.data_ptr<float>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) { int8_encode(src, n, begin, end, dst, nullptr); });
    if (tail_ > 0) std::memcpy(dst + n + 4 * blocks, src + n, 4 * tail_);
    return;
  }
  at::Tensor wide = x.narrow(0, 0, n).to(at::kFloat);
  if (blocks * kInt8Block != n) wide = at::constant_pad_nd(wide, {0, blocks * kInt8Block - n}, 0.0);
  wide = wide.view({blocks, kInt8Block});
  at::Tensor scale = wide.abs().amax(1, /*keepdim=*/true).div_(127.0);
  scale.masked_fill_(scale.eq(0), 1.0);
  // A block holding inf or NaN has a non-finite scale: its q are 0 and every element decodes to
  // NaN (0 * inf, 0 * NaN), so a found-inf check after the wire still sees it.
  at::Tensor q = at::nan_to_num(at::round(wide / scale).clamp_(-127, 127), 0.0, 0.0, 0.0);
  q.masked_fill_(scale.isfinite().logical_not().expand_as(q), 0.0);
  q = q.to(at::kChar).view(-1).narrow(0, 0, n);
  packed.narrow(0, 0, n).copy_(q.view(at::kByte));
  packed.narrow(0, n, 4 * blocks).copy_(scale.view(-1).view(at::kByte));
  if (tail_ > 0) packed.narrow(0, n + 4 * blocks, 4 * tail_).copy_(x.narrow(0, n, tail_).to(at::kFloat).view(at::kByte));
}

void detail::WireCodec::decode_into(const at::Tensor& packed, at::Tensor out) const {
  if (wire_ == at::kBFloat16 && cpu_float(out) && cpu_bf16(packed) && packed.numel() == out.numel()) {
    const uint16_t* src = bf16_bits(packed);
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, out.numel(), kBf16Grain,
                     [&](int64_t begin, int64_t end) { bf16_decode(src, begin, end, dst); });
    return;
  }
  if (!int8()) {
    out.copy_(packed);
    return;
  }
  const int64_t n = out.numel() - tail_, blocks = (n + kInt8Block - 1) / kInt8Block;
  if (cpu_float(out) && packed.is_cpu() && packed.is_contiguous()) {
    const uint8_t* src = packed.data_ptr<uint8_t>();
    float* dst = out.data_ptr<float>();
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) { int8_decode(src, n, begin, end, dst); });
    if (tail_ > 0) std::memcpy(dst + n, src + n + 4 * blocks, 4 * tail_);
    return;
  }
  if (tail_ > 0) out.narrow(0, n, tail_).copy_(packed.narrow(0, n + 4 * blocks, 4 * tail_).clone().view(at::kFloat));
  out = out.narrow(0, 0, n);
  at::Tensor q = packed.narrow(0, 0, n).view(at::kChar).to(at::kFloat);
  at::Tensor scale = packed.narrow(0, n, 4 * blocks).clone().view(at::kFloat);
  if (blocks * kInt8Block != n) q = at::constant_pad_nd(q, {0, blocks * kInt8Block - n}, 0.0);
  at::Tensor values = (q.view({blocks, kInt8Block}) * scale.view({blocks, 1})).view(-1).narrow(0, 0, n);
  out.copy_(values);
}

void detail::WireCodec::encode_rounding(const at::Tensor& source, at::Tensor x, at::Tensor packed) const {
  SHARDOPT_CHECK(source.numel() == x.numel() && source.scalar_type() == x.scalar_type(),
                 "wire encode: ", source.numel(), " source elements of ", source.scalar_type(), " for ", x.numel(),
                 " of ", x.scalar_type());
  if (int8() && cpu_float(x) && cpu_float(source) && packed.is_cpu() && packed.is_contiguous() &&
      packed.numel() == packed_numel(x.numel()) && packed.scalar_type() == packed_dtype()) {
    const int64_t n = x.numel() - tail_, blocks = (n + kInt8Block - 1) / kInt8Block;
    const float* src = source.const_data_ptr<float>();
    float* values = x.data_ptr<float>();
    uint8_t* dst = packed.data_ptr<uint8_t>();
    at::parallel_for(0, blocks, 16,
                     [&](int64_t begin, int64_t end) { int8_encode(src, n, begin, end, dst, values); });
    if (tail_ > 0) {
      std::memcpy(dst + n + 4 * blocks, src + n, 4 * tail_);
      if (values != src) std::memcpy(values + n, src + n, 4 * tail_);
    }
    return;
  }
  if (wire_ == at::kBFloat16 && cpu_float(x) && cpu_float(source) && cpu_bf16(packed) &&
      packed.numel() == x.numel()) {  // one pass, ATen's bits
    const float* src = source.const_data_ptr<float>();
    float* values = x.data_ptr<float>();
    uint16_t* dst = bf16_bits(packed);
    at::parallel_for(0, x.numel(), kBf16Grain,
                     [&](int64_t begin, int64_t end) { bf16_encode(src, begin, end, dst, values); });
    return;
  }
  encode_into(source, packed);
  decode_into(packed, x);
}

at::Tensor detail::WireCodec::round_trip(const at::Tensor& x) const {
  at::Tensor out = at::empty_like(x);
  decode_into(encode(x.reshape(-1)), out.view(-1));
  return out;
}

namespace {

using detail::from_bf16_bits;
using detail::to_bf16_bits;

// The bf16 wire's feedback step over [begin, end): v = x + residual, x = v rounded to bf16,
// residual = v - x rounded to bf16.
void bf16_feed_back(float* x, uint16_t* residual, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) {
    const float v = x[i] + from_bf16_bits(residual[i]);
    const float sent = from_bf16_bits(to_bf16_bits(v));
    residual[i] = to_bf16_bits(v - sent);
    x[i] = sent;
  }
}

}  // namespace

void detail::WireCodec::feed_back(at::Tensor x, at::Tensor residual) const {
  if (x.is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 1 && x.is_contiguous() &&
      residual.scalar_type() == at::kBFloat16 && residual.is_contiguous() && residual.numel() == x.numel() &&
      (int8() || wire_ == at::kBFloat16)) {
    float* values = x.data_ptr<float>();
    auto* kept = reinterpret_cast<uint16_t*>(residual.data_ptr<at::BFloat16>());
    const int64_t n = x.numel();
    if (int8()) {
      const int64_t blocks = (n + kInt8Block - 1) / kInt8Block;
      at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) { int8_feed_back(values, kept, n, begin, end); });
    } else {
      at::parallel_for(0, n, 1 << 14, [&](int64_t begin, int64_t end) { bf16_feed_back(values, kept, begin, end); });
    }
    return;
  }
  x.add_(residual);
  const at::Tensor sent = round_trip(x);  // what arrives
  residual.copy_(x.sub_(sent));           // what the rounding drops, in fp32, then held in bf16
  x.copy_(sent);
}

std::string wire_name(Wire wire) {
  switch (wire) {
    case Wire::kExact: return "exact";
    case Wire::kBFloat16: return "bf16";
    case Wire::kInt8: return "int8";
  }
  return "unknown";
}

Wire wire_from_name(const std::string& name) {
  for (Wire wire : {Wire::kExact, Wire::kBFloat16, Wire::kInt8}) {
    if (wire_name(wire) == name) return wire;
  }
  SHARDOPT_CHECK(false, "unknown wire \"", name, "\"; expected exact, bf16 or int8");
  return Wire::kExact;
}

std::optional<at::ScalarType> wire_dtype(Wire wire, at::ScalarType dtype) {
  if (wire == Wire::kExact) return std::nullopt;
  if (wire == Wire::kInt8) return at::isFloatingType(dtype) ? std::optional<at::ScalarType>(at::kChar) : std::nullopt;
  if (dtype != at::kFloat && dtype != at::kDouble) return std::nullopt;
  return at::kBFloat16;
}

}  // namespace shardopt
