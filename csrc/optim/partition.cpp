#include <shardopt/optim/partition.h>
#include <shardopt/check.h>

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>

namespace shardopt {

namespace {

int argmax(const std::vector<int64_t>& v) {
  return static_cast<int>(std::max_element(v.begin(), v.end()) - v.begin());
}
int argmin(const std::vector<int64_t>& v) {
  return static_cast<int>(std::min_element(v.begin(), v.end()) - v.begin());
}

// One improvement between the most- and least-loaded ranks: the move or swap that lowers the
// larger of the two loads the most. Returns false when none helps.
bool improve(const std::vector<int64_t>& weights, std::vector<int>& owner, std::vector<int64_t>& loads) {
  const int hi = argmax(loads), lo = argmin(loads);
  if (hi == lo) return false;
  const int64_t gap = loads[hi] - loads[lo];
  // Moving weight d from hi to lo helps when 0 < d < gap; the best d is closest to gap / 2.
  int64_t best_d = 0;
  long best_i = -1, best_j = -1;
  auto consider = [&](int64_t d, long i, long j) {
    if (d <= 0 || d >= gap) return;
    if (best_i < 0 || std::llabs(2 * d - gap) < std::llabs(2 * best_d - gap)) {
      best_d = d, best_i = i, best_j = j;
    }
  };
  std::vector<long> on_hi, on_lo;
  for (long i = 0; i < static_cast<long>(weights.size()); ++i) {
    if (owner[i] == hi) on_hi.push_back(i);
    if (owner[i] == lo) on_lo.push_back(i);
  }
  // Swaps cost |hi| * |lo| to search; past a few million pairs only moves are tried.
  const bool try_swaps = on_hi.size() * on_lo.size() <= (1u << 22);
  for (long i : on_hi) {
    consider(weights[i], i, -1);
    if (!try_swaps) continue;
    for (long j : on_lo) consider(weights[i] - weights[j], i, j);
  }
  if (best_i < 0) return false;
  owner[best_i] = lo;
  if (best_j >= 0) owner[best_j] = hi;
  loads[hi] -= best_d;
  loads[lo] += best_d;
  return true;
}

// improve() until nothing helps; bounded so a pathological input cannot make it slow.
void local_search(const std::vector<int64_t>& weights, std::vector<int>& owner, std::vector<int64_t>& loads) {
  const size_t max_rounds = std::min<size_t>(4 * weights.size() + 16, 512);
  for (size_t round = 0; round < max_rounds && improve(weights, owner, loads); ++round) {
  }
}

}  // namespace

void Partition::index_shards() {
  shards_.assign(world_size_, {});
  for (size_t i = 0; i < owner_.size(); ++i) shards_[owner_[i]].push_back(i);
}

Partition Partition::balance(const std::vector<int64_t>& weights, int world_size) {
  SHARDOPT_CHECK(world_size >= 1, "Partition needs world_size >= 1, got ", world_size);
  for (size_t i = 0; i < weights.size(); ++i) {
    SHARDOPT_CHECK(weights[i] >= 0, "Partition weight of parameter ", i, " is negative (", weights[i], ")");
  }
  Partition p;
  p.world_size_ = world_size;
  p.owner_.assign(weights.size(), 0);
  p.loads_.assign(world_size, 0);

  // Sorted greedy: largest first (ties by position), to the least-loaded rank (ties: lowest rank).
  std::vector<size_t> order(weights.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return weights[a] > weights[b]; });
  for (size_t i : order) {
    int r = argmin(p.loads_);
    p.owner_[i] = r;
    p.loads_[r] += weights[i];
  }
  local_search(weights, p.owner_, p.loads_);
  p.index_shards();
  return p;
}

Partition Partition::balance(const std::vector<int64_t>& weights, int world_size,
                             const std::vector<uint8_t>& trainable) {
  SHARDOPT_CHECK(trainable.size() == weights.size(), "Partition got ", weights.size(), " weights but ",
              trainable.size(), " trainable flags");
  std::vector<int64_t> active(weights.size(), 0);
  std::vector<size_t> frozen;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (trainable[i]) {
      active[i] = weights[i];
    } else {
      frozen.push_back(i);
    }
  }
  Partition p = balance(active, world_size);
  if (frozen.empty()) return p;
  std::vector<int64_t> held = p.loads_;
  std::stable_sort(frozen.begin(), frozen.end(), [&](size_t a, size_t b) { return weights[a] > weights[b]; });
  for (size_t i : frozen) {
    const int r = argmin(held);
    p.owner_[i] = r;
    held[r] += weights[i];
  }
  p.index_shards();
  return p;
}

Partition Partition::rebalance(const Partition& from, const std::vector<int64_t>& weights,
                               const std::vector<uint8_t>& trainable) {
  SHARDOPT_CHECK(weights.size() == from.owner_.size() && trainable.size() == from.owner_.size(),
              "Partition of ", from.owner_.size(), " parameters asked to rebalance ", weights.size(),
              " weights and ", trainable.size(), " flags");
  // improve() only looks at the parameters it may move; frozen ones weigh nothing here, and a
  // zero weight is never moved (a move must lower the larger load).
  std::vector<int64_t> active(weights.size(), 0);
  for (size_t i = 0; i < weights.size(); ++i) active[i] = trainable[i] ? weights[i] : 0;
  Partition p;
  p.world_size_ = from.world_size_;
  p.owner_ = from.owner_;
  p.loads_.assign(p.world_size_, 0);
  for (size_t i = 0; i < active.size(); ++i) p.loads_[p.owner_[i]] += active[i];
  local_search(active, p.owner_, p.loads_);
  p.index_shards();
  return p;
}

namespace {

// The weight each rank holds: trainable parameters, and frozen ones in `kept`.
std::vector<int64_t> held_loads(const std::vector<int>& owner, int world_size, const std::vector<int64_t>& weights,
                                const std::vector<uint8_t>& trainable, const std::vector<uint8_t>& kept) {
  SHARDOPT_CHECK(weights.size() == owner.size() && trainable.size() == owner.size() && kept.size() == owner.size(),
                 "Partition of ", owner.size(), " parameters asked about ", weights.size(), " weights, ",
                 trainable.size(), " trainable and ", kept.size(), " kept flags");
  std::vector<int64_t> loads(world_size, 0);
  for (size_t i = 0; i < owner.size(); ++i) {
    if (trainable[i] || kept[i]) loads[owner[i]] += weights[i];
  }
  return loads;
}

double imbalance_of(const std::vector<int64_t>& loads) {
  const int64_t sum = std::accumulate(loads.begin(), loads.end(), int64_t{0});
  if (sum == 0) return 0.0;
  const double mean = static_cast<double>(sum) / static_cast<double>(loads.size());
  return static_cast<double>(*std::max_element(loads.begin(), loads.end())) / mean - 1.0;
}

}  // namespace

Partition Partition::spread_kept(const Partition& from, const std::vector<int64_t>& weights,
                                 const std::vector<uint8_t>& trainable, const std::vector<uint8_t>& kept) {
  Partition p;
  p.world_size_ = from.world_size_;
  p.owner_ = from.owner_;
  // Only kept frozen parameters weigh anything to improve(): nothing else moves.
  std::vector<int64_t> movable(weights.size(), 0);
  for (size_t i = 0; i < weights.size(); ++i) movable[i] = !trainable[i] && kept[i] ? weights[i] : 0;
  std::vector<int64_t> held = held_loads(p.owner_, p.world_size_, weights, trainable, kept);
  local_search(movable, p.owner_, held);
  // Moves from where the state is can get stuck (the busiest rank keeps only tensors larger than
  // the gap); placing all kept parameters afresh, largest first on the rank holding the least,
  // then improving, is taken instead when it balances better. It moves more state.
  std::vector<int> fresh = from.owner_;
  std::vector<int64_t> fresh_held = held_loads(fresh, p.world_size_, weights, trainable, std::vector<uint8_t>(kept.size(), 0));
  std::vector<size_t> order;
  for (size_t i = 0; i < weights.size(); ++i) {
    if (movable[i] > 0) order.push_back(i);
  }
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return weights[a] > weights[b]; });
  for (size_t i : order) {
    fresh[i] = argmin(fresh_held);
    fresh_held[fresh[i]] += weights[i];
  }
  local_search(movable, fresh, fresh_held);
  if (*std::max_element(fresh_held.begin(), fresh_held.end()) < *std::max_element(held.begin(), held.end())) {
    p.owner_ = std::move(fresh);
  }
  p.loads_.assign(p.world_size_, 0);
  for (size_t i = 0; i < weights.size(); ++i) p.loads_[p.owner_[i]] += trainable[i] ? weights[i] : 0;
  p.index_shards();
  return p;
}

double Partition::held_imbalance(const std::vector<int64_t>& weights, const std::vector<uint8_t>& trainable,
                                 const std::vector<uint8_t>& kept) const {
  return imbalance_of(held_loads(owner_, world_size_, weights, trainable, kept));
}

double Partition::imbalance(const std::vector<int64_t>& weights, const std::vector<uint8_t>& trainable) const {
  SHARDOPT_CHECK(weights.size() == owner_.size() && trainable.size() == owner_.size(), "Partition of ",
              owner_.size(), " parameters asked about ", weights.size(), " weights and ", trainable.size(), " flags");
  return imbalance_of(held_loads(owner_, world_size_, weights, trainable, std::vector<uint8_t>(owner_.size(), 0)));
}

int64_t Partition::total() const {
  return std::accumulate(loads_.begin(), loads_.end(), int64_t{0});
}

double Partition::imbalance() const {
  return imbalance_of(loads_);
}

}  // namespace shardopt
