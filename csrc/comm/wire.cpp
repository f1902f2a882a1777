// Compressed wires (shardopt/comm/wire.h).
#include <shardopt/comm/wire.h>
#include <shardopt/check.h>

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

}  // namespace shardopt
