// The sums a rank computes of what others sent it (comm/sum_into.h): the reduce to one owner and
// the rows' reduce-scatter, exact or from a narrower wire.
#include "comm/sum_into.h"
#include "comm/wire_kernels.h"
#include "comm/wire_codec.h"

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace shardopt {

namespace detail {
namespace {

// tensor += each of `incoming` in turn; then tensor[0, numel) /= divisor. For dense float and
// double in one pass over memory, chunk by chunk, with the rounding of add_ then div_ (each sum
// rounded, then a true division by the divisor in the tensor's type); other types take those
// two operators.
// out = first + in[0] + in[1] + ... (first may be out), then out[0, numel) /= divisor. The
// additions into `out` itself are written as such: the loops the compiler vectorises best.
template <typename T>
void sum_then_divide(T* out, const T* first, const std::vector<const T*>& in, int64_t begin, int64_t end,
                     int64_t numel, T divisor) {
  const size_t last = in.size() - 1;
  size_t k = 0;
  if (first != out) {  // the first addition writes `out` from `first`
    const T* src = in[0];
    const int64_t split = last == 0 ? std::clamp(numel, begin, end) : begin;
    for (int64_t i = begin; i < split; ++i) out[i] = (first[i] + src[i]) / divisor;
    for (int64_t i = split; i < end; ++i) out[i] = first[i] + src[i];
    if (last == 0) return;
    k = 1;
  }
  for (; k < last; ++k) {
    const T* src = in[k];
    for (int64_t i = begin; i < end; ++i) out[i] += src[i];
  }
  const T* src = in[last];
  const int64_t split = std::clamp(numel, begin, end);
  for (int64_t i = begin; i < split; ++i) out[i] = (out[i] + src[i]) / divisor;
  for (int64_t i = split; i < end; ++i) out[i] += src[i];
}

}  // namespace

void sum_to(at::Tensor& out, const at::Tensor& first, const std::vector<at::Tensor>& incoming, int64_t numel,
            double divisor) {
  const bool fused = out.device().is_cpu() && out.is_contiguous() && first.is_contiguous() &&
                     first.scalar_type() == out.scalar_type() &&
                     (out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble);
  if (!fused || incoming.empty()) {
    if (!out.is_same(first)) out.copy_(first);
    for (const auto& t : incoming) out.add_(t);
    if (divisor != 1.0 && numel > 0) out.narrow(0, 0, numel).div_(divisor);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(out.scalar_type(), "reduce_sum_into", [&] {
    std::vector<const scalar_t*> in;
    for (const auto& t : incoming) in.push_back(t.const_data_ptr<scalar_t>());
    scalar_t* dst = out.data_ptr<scalar_t>();
    const scalar_t* src = first.const_data_ptr<scalar_t>();
    const auto d = static_cast<scalar_t>(divisor);
    // Chunks small enough that a partial sum stays in cache between the incoming tensors.
    constexpr int64_t kChunk = int64_t{1} << 14;
    at::parallel_for(0, out.numel(), kChunk, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; b += kChunk) {
        sum_then_divide(dst, src, in, b, std::min(end, b + kChunk), numel, d);
      }
    });
  });
}

void sum_into(at::Tensor& tensor, const std::vector<at::Tensor>& incoming, int64_t numel, double divisor) {
  sum_to(tensor, tensor, incoming, numel, divisor);
}

void sum_widened(at::Tensor& out, const at::Tensor& own, const std::vector<at::Tensor>& incoming, int64_t numel,
                 double divisor) {
  bool fused = out.is_cpu() && own.is_cpu() && out.is_contiguous() && own.is_contiguous() &&
               out.scalar_type() == at::kFloat && own.scalar_type() == at::kFloat && own.numel() == out.numel();
  for (const auto& t : incoming) {
    fused = fused && t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kBFloat16 && t.numel() == out.numel();
  }
  if (!fused) {
    const auto wire = incoming.empty() ? at::kBFloat16 : incoming.front().scalar_type();
    at::Tensor sum = own.to(wire).to(out.scalar_type());
    std::vector<at::Tensor> wide;
    for (const auto& t : incoming) wide.push_back(t.to(out.scalar_type()));
    sum_into(sum, wide, numel, divisor);
    out.copy_(sum);
    return;
  }
  float* dst = out.data_ptr<float>();
  const float* mine = own.const_data_ptr<float>();
  std::vector<const uint16_t*> in;
  for (const auto& t : incoming) {
    in.push_back(reinterpret_cast<const uint16_t*>(t.const_data_ptr<c10::BFloat16>()));
  }
  const auto d = static_cast<float>(divisor);
  at::parallel_for(0, out.numel(), int64_t{1} << 14, [&](int64_t begin, int64_t end) {
    bf16_sum(mine, in.data(), in.size(), begin, end, numel, d, dst);
  });
}

void sum_decoded(at::Tensor& out, const at::Tensor& own, const std::vector<at::Tensor>& incoming,
                 const WireCodec& codec, int64_t numel, double divisor) {
  if (!codec.int8()) {
    sum_widened(out, own, incoming, numel, divisor);
    return;
  }
  const bool fused = out.is_cpu() && out.is_contiguous() && out.scalar_type() == at::kFloat && own.is_cpu() &&
                     own.is_contiguous() && own.scalar_type() == at::kFloat && own.numel() == out.numel();
  if (fused) {  // one pass: each block of its own round trip, then every incoming block added
    const int64_t total = out.numel(), tail = codec.exact_tail(), body = total - tail;
    const int64_t blocks = (body + kInt8Block - 1) / kInt8Block;
    const float* mine = own.data_ptr<float>();
    float* dst = out.data_ptr<float>();
    std::vector<const uint8_t*> in;
    for (const auto& t : incoming) in.push_back(t.data_ptr<uint8_t>());
    const auto d = static_cast<float>(divisor);
    auto finish = [&](int64_t i, float acc) { dst[i] = i < numel ? acc / d : acc; };
    // (each product rounded apart from its sum: the unfused path's bits)
    at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
      int8_sum(mine, in.data(), in.size(), body, begin, end, numel, d, dst);
    });
    for (int64_t t = 0; t < tail; ++t) {
      float acc = mine[body + t];
      for (const uint8_t* src : in) {
        float v;
        std::memcpy(&v, src + body + 4 * blocks + 4 * t, 4);
        acc += v;
      }
      finish(body + t, acc);
    }
    return;
  }
  // In fp32 whatever the bucket's dtype: a bf16 or fp16 bucket (mixed precision's reduce_dtype)
  // is rounded once, after the sum and the division (Note [Int8 wire]).
  const auto wide = out.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  std::vector<at::Tensor> decoded;
  for (const auto& packed : incoming) {
    at::Tensor values = at::empty({out.numel()}, out.options().dtype(wide));
    codec.decode_into(packed, values);
    decoded.push_back(values);
  }
  const at::Tensor first = codec.round_trip(own.reshape(-1).to(wide));
  if (out.scalar_type() == wide) {
    sum_to(out, first, decoded, numel, divisor);
    return;
  }
  at::Tensor sum = first;  // a tensor of its own (round_trip's): summed in place
  sum_into(sum, decoded, numel, divisor);
  out.copy_(sum);
}

}  // namespace detail
}  // namespace shardopt
