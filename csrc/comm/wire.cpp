// Compressed wires (shardopt/comm/wire.h).
#include <shardopt/comm/wire.h>
#include <shardopt/check.h>

#include "comm/sum_into.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <vector>

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
// hierarchical sharding only the reduce-scatter within the block is compressed; the all-reduce of
// the owned row across blocks stays exact, so every block receives the same bits. Buckets already
// in bf16 or fp16 (MixedPrecision::reduce_dtype) travel as they are.

std::string wire_name(Wire wire) {
  switch (wire) {
    case Wire::kExact: return "exact";
    case Wire::kBFloat16: return "bf16";
    case Wire::kInt8: return "int8";
  }
  return "unknown";
}

std::optional<at::ScalarType> wire_dtype(Wire wire, at::ScalarType dtype) {
  if (wire != Wire::kBFloat16) return std::nullopt;
  if (dtype != at::kFloat && dtype != at::kDouble) return std::nullopt;
  return at::kBFloat16;
}

namespace detail {

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
  std::vector<const c10::BFloat16*> in;
  for (const auto& t : incoming) in.push_back(t.const_data_ptr<c10::BFloat16>());
  const auto d = static_cast<float>(divisor);
  // Chunks small enough for the partial sum to stay in cache while the incoming rows are added.
  constexpr int64_t kChunk = int64_t{1} << 13;
  at::parallel_for(0, out.numel(), kChunk, [&](int64_t begin, int64_t end) {
    float acc[kChunk];
    for (int64_t b = begin; b < end; b += kChunk) {
      const int64_t n = std::min(end, b + kChunk) - b;
      for (int64_t j = 0; j < n; ++j) acc[j] = static_cast<float>(c10::BFloat16(mine[b + j]));
      for (const c10::BFloat16* src : in) {
        for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<float>(src[b + j]);
      }
      const int64_t divided = std::clamp(numel - b, int64_t{0}, n);
      for (int64_t j = 0; j < divided; ++j) dst[b + j] = acc[j] / d;
      for (int64_t j = divided; j < n; ++j) dst[b + j] = acc[j];
    }
  });
}

}  // namespace detail
}  // namespace shardopt
