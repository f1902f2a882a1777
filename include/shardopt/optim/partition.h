// Partition: which rank owns each parameter's optimizer state.
//
// A pure, deterministic function of the parameters' weights (bytes of optimizer state each will
// hold) and the world size, so every rank computes the same answer without communicating.
// Whole parameters are assigned (never split): largest first to the least-loaded rank (sorted
// greedy), then improved by moves and swaps between the most- and least-loaded ranks while that
// lowers the maximum load.
#pragma once

#include <cstdint>
#include <vector>

namespace shardopt {

class Partition {
 public:
  Partition() = default;
  // weights[i] >= 0 for parameter i; world_size >= 1.
  static Partition balance(const std::vector<int64_t>& weights, int world_size);
  // Balances the trainable parameters first (the work of a step), then places each frozen one,
  // largest first, on the rank holding the least weight in all (its state only waits there).
  // load() and imbalance() count the trainable weight only. All trainable: same as balance().
  static Partition balance(const std::vector<int64_t>& weights, int world_size, const std::vector<uint8_t>& trainable);
  // Starting from `from`, moves and swaps trainable parameters between the ranks with the most
  // and the least trainable weight while that lowers the maximum; frozen parameters stay where
  // they are. Few parameters change owner, so little optimizer state has to move.
  static Partition rebalance(const Partition& from, const std::vector<int64_t>& weights,
                             const std::vector<uint8_t>& trainable);

  // Places frozen parameters with state (`kept`) so that the most any rank holds in all
  // (trainable and kept weight) is as low as it can find: moves and swaps between the ranks
  // holding the most and the least, starting from `from`, or, where that balances better, a fresh
  // largest-first placement improved the same way (Note [Kept state]). Trainable parameters stay
  // where they are, so the trainable balance is unchanged.
  static Partition spread_kept(const Partition& from, const std::vector<int64_t>& weights,
                               const std::vector<uint8_t>& trainable, const std::vector<uint8_t>& kept);
  // max / mean - 1 of the weight each rank holds in all: its trainable parameters and the frozen
  // ones in `kept`.
  double held_imbalance(const std::vector<int64_t>& weights, const std::vector<uint8_t>& trainable,
                        const std::vector<uint8_t>& kept) const;

  int world_size() const { return world_size_; }
  size_t num_params() const { return owner_.size(); }
  int owner(size_t param) const { return owner_.at(param); }
  // Parameters owned by `rank`, in ascending order: the shard.
  const std::vector<size_t>& shard(int rank) const { return shards_.at(rank); }
  int64_t load(int rank) const { return loads_.at(rank); }
  // max / mean - 1 of the trainable weight each rank would step under this partition.
  double imbalance(const std::vector<int64_t>& weights, const std::vector<uint8_t>& trainable) const;
  int64_t total() const;
  // max load / mean load - 1 (0 = perfect balance).
  double imbalance() const;

 private:
  void index_shards();  // shards_ from owner_

  int world_size_ = 1;
  std::vector<int> owner_;
  std::vector<std::vector<size_t>> shards_;
  std::vector<int64_t> loads_;
};

}  // namespace shardopt
