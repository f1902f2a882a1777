// The sum a rank computes of what others sent it (reduce to one owner, rows). Internal.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace shardopt::detail {

// tensor += each of `incoming` in turn (same shape, contiguous); then tensor[0, numel) /=
// divisor. Rounded as ATen's add_ in that order then div_.
void sum_into(at::Tensor& tensor, const std::vector<at::Tensor>& incoming, int64_t numel, double divisor);
// The same with the result in `out`: out = first + each of `incoming` in turn, rounded alike.
void sum_to(at::Tensor& out, const at::Tensor& first, const std::vector<at::Tensor>& incoming, int64_t numel,
            double divisor);

// out = round(own) + widen(incoming[0]) + widen(incoming[1]) + ..., each addition rounded to
// out's dtype, then out[0, numel) /= divisor: the sum of a reduction whose contributions travelled
// in `incoming`'s narrower dtype (Note [Gradient wire]), its own contribution `own` rounded to
// that dtype too. One pass over memory for fp32 `out` and `own` (which may be `out`) with bf16
// `incoming`, all contiguous on the CPU; other dtypes take ATen's casts and add_.
void sum_widened(at::Tensor& out, const at::Tensor& own, const std::vector<at::Tensor>& incoming, int64_t numel,
                 double divisor);

class WireCodec;
// The same for contributions packed by `codec` (bf16: sum_widened; int8: each decoded, `own`
// through the codec too, summed in out's dtype in order; Note [Int8 wire]).
void sum_decoded(at::Tensor& out, const at::Tensor& own, const std::vector<at::Tensor>& incoming,
                 const WireCodec& codec, int64_t numel, double divisor);

}  // namespace shardopt::detail
