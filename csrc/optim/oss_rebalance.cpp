// OSS's re-partition after the trainable set changed (Note [Rebalance after a freeze]).
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>

#include "optim/shard_store.h"

namespace shardopt {

// ---- re-partitioning ---------------------------------------------------------------------------

// Note [Rebalance after a freeze]
// The partition balances the trainable parameters first and spreads the frozen ones by total
// weight (Partition::balance with flags). When the trainable set changes, the work a step does
// can become lopsided (freezing every other tensor of a GPT-2-shaped model leaves one of two
// ranks 1.77x the mean). If the old partition is more than rebalance_threshold above the mean
// for the new set, rebalance() improves it by moves and swaps of trainable parameters
// (Partition::rebalance: few change owner). Then, if some rank holds more than kKeptImbalance
// above its share of all the state (trainable and kept, Note [Kept state]), frozen parameters
// with state move between the ranks holding the most and the least (Partition::spread_kept);
// their state is kept unchanged for when they are unfrozen. Each parameter that changes owner
// takes its optimizer state, and any gradient the old owner holds, to the new one (serialized
// with the state_dict codec, one pair of ranks at a time), and the flat buffers are laid out
// again, so the parameters' data moves with them. Every input of the decision (the mask, the
// partition, the weights, the parameters stepped so far) is the same on every rank, so all
// ranks decide alike without communicating. The step in which the set changed still runs on the
// old partition; the re-partition follows it.
bool OSS::rebalance() {
  if (!repartition_due_) return false;
  repartition_due_ = false;
  const std::vector<uint8_t> trainable = store_->trainable();  // the plan is replaced below
  if (!options_.rebalance() || group_->size() == 1 || !all_registered()) return false;
  // Split ranges are equal for every trainable set (Note [Split parameters]), kept ones too; the
  // partition places only what stays whole (Note [Ownership by kind]).
  bool any_whole = !placement_.split;
  for (size_t i = 0; i < params_.size() && !any_whole; ++i) any_whole = placement_.whole_kind[i];
  if (!any_whole) return false;
  const std::vector<int64_t> weights = placement_.partition_weights();
  const Partition& now = store_->partition();
  const double before = now.imbalance(weights, trainable);
  std::vector<uint8_t> kept(params_.size(), 0);
  for (size_t i = 0; i < params_.size(); ++i) kept[i] = !trainable[i] && store_->stepped()[i];
  Partition next = repartition(now, weights, trainable, kept, options_.rebalance_threshold());
  bool moved = false;
  for (size_t i = 0; i < params_.size() && !moved; ++i) moved = next.owner(i) != now.owner(i);
  if (!moved) return false;

  settle_state();  // state still owed from an earlier layout goes first
  last_rebalance_ = RebalanceStats();
  last_rebalance_.imbalance_before = before;
  last_rebalance_.imbalance_after = next.imbalance(weights, trainable);
  ++partition_version_;
  lay_out(store_->make_plan(trainable, std::move(next)));
  settle_state();
  return true;
}

}  // namespace shardopt
