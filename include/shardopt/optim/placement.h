// Placement: where OSS puts each parameter's optimizer state, decided from shapes alone.
//
// These are the decisions OSS makes (Note [Ownership by kind], Note [Split parameters], Note
// [Rebalance after a freeze] in csrc/optim/): what each parameter weighs, whether parameters are
// split into equal ranges or kept whole, the partition, the FlatLayout's inputs, and which rank
// holds which range of a parameter's state. OSS calls them with its parameters' shapes; `shardopt
// plan` calls them with a model's shapes and no tensors, so a plan is the layout training would
// make, padding and buckets included. Pure functions: every rank computes the same answer.
#pragma once

#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/partition.h>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

namespace shardopt {

// What placement needs to know of one parameter.
struct ParamShape {
  std::vector<int64_t> sizes;
  c10::ScalarType dtype = c10::kFloat;  // as laid out: param_dtype under mixed precision
  c10::Device device = c10::Device(c10::kCPU);
  bool trainable = true;
  // Its optimizer is one whose state shardopt can move (built in or registered).
  bool registered = true;
  // Its optimizer needs the whole tensor (StateKind::kWholeTensor).
  bool whole_tensor = false;
  // kWholeTensor: the cost of its update (the registration's cost; Muon: muon_cost).
  double cost = 0.0;
  int64_t numel() const;
};

// How OSS chose to place the parameters at construction.
struct Placement {
  // Per parameter, what a step on it costs: its bytes for an element-wise optimizer; for a
  // whole-tensor one its cost, scaled so that those parameters' costs sum to their bytes.
  std::vector<int64_t> weights;
  std::vector<uint8_t> whole_kind;  // per parameter: stays whole on one owner (its optimizer's kind)
  bool split = false;               // element-wise parameters cut into equal ranges
  double whole_imbalance = 0.0;     // of the whole-parameter partition (PartitionMode::kAuto)
  Partition partition;              // who owns each parameter kept whole, at construction
  // What the partition balances: every weight, or only the whole-kind ones' when split.
  std::vector<int64_t> partition_weights() const;
  // Whether parameter `param` stays whole on one owner.
  bool kept_whole(size_t param) const { return !split || whole_kind.at(param); }
};

enum class PartitionMode;

// OSS's decision at construction for `params` over `world_size` ranks (the shard group's size
// under hierarchical sharding). `mode` and `split_above_imbalance` are OSSOptions';
// `all_registered`: every optimizer of the OSS is one whose state shardopt can move (those with no
// parameters included). Errors name the parameter (a cost that is not finite and >= 0) or the mode
// (kSplit with an optimizer shardopt cannot move state for).
Placement place_params(const std::vector<ParamShape>& params, int world_size, PartitionMode mode,
                       double split_above_imbalance, bool all_registered);

// OSS's re-partition after the trainable set changed (Note [Rebalance after a freeze]): starting
// from `now`, better owners for the trainable work when it is more than `threshold` above the
// mean, then the frozen parameters with state (`kept`) spread so that every rank holds its share
// in all. `weights`: Placement::partition_weights(). Returns `now` when nothing should move.
Partition repartition(const Partition& now, const std::vector<int64_t>& weights, const std::vector<uint8_t>& trainable,
                      const std::vector<uint8_t>& kept, double threshold);

// The FlatLayout's inputs: one LayoutParam per parameter, owned as `partition` says, trainable
// as `trainable` says, frozen ones with state to keep where `stepped`, whole-kind ones marked.
std::vector<LayoutParam> layout_params(const std::vector<ParamShape>& params, const Partition& partition,
                                       const std::vector<uint8_t>& trainable, const std::vector<uint8_t>& stepped,
                                       const std::vector<uint8_t>& whole_kind);

// The ranks that hold the state of parameter `param` (`numel` elements) under `layout`, with the
// range each holds: `partition`'s owner for a parameter kept whole, its pieces' owners when it is
// trainable, its keepers when it is frozen with state (split layouts). nullopt for a frozen split
// parameter without state to keep: it stays wherever it was.
std::optional<std::vector<std::pair<int, Range>>> held_ranges(const FlatLayout& layout, const Partition& partition,
                                                              bool kept_whole, bool trainable, size_t param,
                                                              int64_t numel);

// Elements of the memory an owner keeps between backward passes for one of its gradient buckets
// under ShardedDDP (Note [Gradient slab]): the bucket's gradients (a row bucket's: one row) and
// one count per piece, rounded up to 16 elements.
int64_t bucket_memory_numel(const FlatBucket& bucket);

}  // namespace shardopt
