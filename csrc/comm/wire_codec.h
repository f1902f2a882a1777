// How a tensor travels on a compressed wire: encoded into a packed tensor that is sent as it is,
// decoded where it arrives (Note [Gradient wire], Note [Int8 wire] in wire.cpp). Internal.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <utility>

namespace shardopt::detail {

// The elements of one int8 block, each block with one fp32 scale (Note [Int8 wire]).
inline constexpr int64_t kInt8Block = 256;

// (Its loops on the CPU: wire_kernels.h. A block's scale is max |x| / 127: 1 for a block of
// zeros, NaN for one holding NaN, inf for one holding inf; its elements round(x / scale), half to
// even, within [-127, 127]; all 0 under a non-finite scale.)

class WireCodec {
 public:
  // `wire`: kBFloat16 (a cast), or kChar (int8 in blocks of kInt8Block with fp32 scales), as
  // wire_dtype() gives it.
  // Under int8 the last `exact_tail` elements travel as they are, in fp32 after the blocks (a
  // row's flags, which must stay 0 or 1).
  explicit WireCodec(at::ScalarType wire, int64_t exact_tail = 0) : wire_(wire), tail_(int8() ? exact_tail : 0) {}
  bool int8() const { return wire_ == at::kChar; }
  int64_t exact_tail() const { return tail_; }
  // The packed form of `numel` elements: its dtype and element count, and its bytes.
  at::ScalarType packed_dtype() const { return int8() ? at::kByte : wire_; }
  int64_t packed_numel(int64_t numel) const;
  int64_t packed_bytes(int64_t numel) const;
  // `x` (1-D, contiguous, floating, any device) packed, on x's device.
  at::Tensor encode(const at::Tensor& x) const;
  // The same into `packed` (packed_numel(x.numel()) elements of packed_dtype(), contiguous).
  void encode_into(const at::Tensor& x, at::Tensor packed) const;
  // encode_into(source, packed), then x (of source's size and dtype; it may be source) set to
  // what a receiver decodes from `packed`: on the CPU for fp32, in one pass (under int8, over
  // each block).
  void encode_rounding(const at::Tensor& source, at::Tensor x, at::Tensor packed) const;
  void encode_rounding(at::Tensor x, at::Tensor packed) const { encode_rounding(x, x, std::move(packed)); }
  // `packed` (of `numel` elements) decoded into `out` (1-D, `numel` elements, floating).
  void decode_into(const at::Tensor& packed, at::Tensor out) const;
  // x as it arrives after the wire: decode(encode(x)), in x's dtype.
  at::Tensor round_trip(const at::Tensor& x) const;
  // Error feedback (Note [Error feedback] in csrc/ddp/reduction.cpp), in place: x += residual,
  // x = round_trip(x), residual = what that dropped (held in residual's dtype, bf16). On the CPU
  // (fp32 x, bf16 residual) one pass over memory (int8_feed_back, or the bf16 wire's loop), with
  // the bits of those operations.
  void feed_back(at::Tensor x, at::Tensor residual) const;

 private:
  at::ScalarType wire_;
  int64_t tail_ = 0;
};

}  // namespace shardopt::detail
