// Moving optimizer state between ranks when the holdings change: a re-partition of whole
// parameters (Note [Rebalance after a freeze] in oss_rebalance.cpp) or new equal ranges after a change of
// the trainable set (Note [Split parameters]). Internal to shardopt.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/optim/oss.h>

#include "optim/codec.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace shardopt::detail {

// An encoded state (state_dict layout) decoded with its tensors next to `like`: copies of them in
// like's dtype, or with `alias` (state that moved between this OSS's holdings) the tensors
// themselves in their own dtypes, on like's device (Note [Decoding without copies] in
// state_migration.cpp).
std::unique_ptr<torch::optim::OptimizerParamState> decode_state_like(const OptimizerCodec& codec,
                                                                     const GenericDict& encoded,
                                                                     const at::Tensor& like, bool alias = false);

// Elements [begin, end) of every state tensor of `encoded` (the state of a range of `numel`
// elements), flat; the other entries ("step", scalars) as they are. The whole range [0, numel):
// every tensor copied as it is, whatever its shape (a whole-tensor optimizer's may have its own).
// Without `copy`, views of `encoded`'s tensors.
GenericDict slice_state(const GenericDict& encoded, int64_t begin, int64_t end, int64_t numel, bool copy = true);

// Per parameter, whether `a` and `b` place its state identically (ranks and ranges).
bool same_holdings(const std::vector<Holding>& a, const std::vector<Holding>& b);

// Where the owned gradient of a holding of parameter `param` is read and written (Note [Owned
// gradients]).
struct HoldingGrads {
  std::function<at::Tensor(size_t param, const Holding&)> get;
  std::function<void(size_t param, const Holding&, at::Tensor)> set;
};

// A range of a new holding's state that migrate_holdings left where it was, for StateSlabs to land
// in its slot (Note [State lands in its slot] in state_migration.cpp): state entry `kind` of the
// holding tensor `key` (a TensorImpl), elements [offset, offset + tensor.numel()) of it.
struct StatePart {
  const void* key = nullptr;
  std::string kind;
  int64_t offset = 0;
  at::Tensor tensor;  // flat: a view of an old slab (state that stays on its rank) or of a payload
  at::TensorOptions options;  // the holding tensor's (its dtype and device)
  const OptimizerCodec* codec = nullptr;
};

// For every parameter whose holdings differ between `from` and `to`, each new holding collects
// the state (and any gradient, through `grads`, where it has none) of its range from the old
// holdings that overlap it: named with the codec of the parameter's optimizer (`local_of`) and sent as raw tensor bytes (Note [State
// moves without pickling]), one pair of ranks at a time in the same order on every rank; what
// stays on a rank is moved locally. State of ranges nobody held yet stays absent. Counts what moved in
// `stats`. With `carry_values` the holdings' tensors are values of their own (mixed precision's
// master weights) and move too. With `parts`, a new holding whose state comes in several
// slices is not joined: its state tensors are placeholders on the meta device, and its slices are
// appended to `parts` for StateSlabs::move_in_place and land_parts to put in its slot. With
// `widen`, the state of each slice that leaves this rank is first replaced by what `widen` makes
// of it (8-bit codes: their fp32 values); the state that stays keeps its tensors. Collective
// (communicates only when a range changes rank).
void migrate_holdings(ProcessGroup& group, const std::function<torch::optim::Optimizer&(size_t param)>& local_of,
                      const std::vector<std::vector<Holding>>& from,
                      const std::vector<std::vector<Holding>>& to, const HoldingGrads& grads, RebalanceStats& stats,
                      bool carry_values = false, std::vector<StatePart>* parts = nullptr,
                      const std::function<GenericDict(const GenericDict&)>& widen = nullptr);

// One range of an old shard (an entry of OSS::state_shard()'s "shard" list) and the member of the
// group that sends it.
struct ShardRange {
  int member = 0;
  size_t param = 0;
  int64_t begin = 0, end = 0;  // parameter frame
  bool state = false, master = false;
};

// Loads old shards' ranges into the new holdings `to` (where the state of a new OSS lives), each
// member receiving only the overlap of each range with its holdings (Note [Each rank receives its
// own ranges] in state_migration.cpp). `ranges` lists every member's ranges (the same table on every member); `mine` holds
// this member's entries, in the order its rows appear in `ranges`. `rank_of(member)` is the rank
// a member's holdings carry (its rank in the shard group). With `carry_values` the entries'
// "master" (mixed precision's fp32 masters) moves too, into the holdings' tensors. Counts what
// this member received in `stats`. Collective over `members`.
void scatter_shard_ranges(ProcessGroup& members, const std::function<int(int member)>& rank_of,
                          const std::function<torch::optim::Optimizer&(size_t param)>& local_of,
                          const std::vector<ShardRange>& ranges, const std::vector<GenericDict>& mine,
                          const std::vector<std::vector<Holding>>& to, RebalanceStats& stats, bool carry_values);

}  // namespace shardopt::detail
