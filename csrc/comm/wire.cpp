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

// Note [Parameter wire]
// OSSOptions::param_wire(kBFloat16) sends the parameter sync after the step in bf16. Quantisation
// error must not accumulate, so the owners step exact values: every rank keeps an fp32 master of
// the ranges it owns (the same machinery as mixed precision's masters, Note [Mixed precision]),
// the wrapped optimizer steps the master, and the owner writes it into its range of the
// parameters. The sync then rounds: each sender first rounds its own range in place (the row of
// an all-gather, the segment of a broadcast) to bf16 and widens it back, then sends the bf16
// bytes, and each receiver widens what arrives. Every rank, the owner included, ends with the
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
  if (wire != Wire::kBFloat16) return std::nullopt;
  if (dtype != at::kFloat && dtype != at::kDouble) return std::nullopt;
  return at::kBFloat16;
}

}  // namespace shardopt
