// Placement: OSS's decisions of who holds what, from shapes alone (Note [Ownership by kind]
// here, Note [Rebalance after a freeze] in oss_rebalance.cpp).
#include <shardopt/optim/placement.h>
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>

#include <c10/util/ArrayRef.h>

#include <algorithm>
#include <cmath>

namespace shardopt {

namespace {

// Whole parameters' kept state spreads when the busiest rank holds more than this above its share.
constexpr double kKeptImbalance = 0.02;

std::string sizes_text(const std::vector<int64_t>& sizes) { return c10::str(c10::IntArrayRef(sizes)); }

}  // namespace

int64_t ParamShape::numel() const {
  int64_t n = 1;
  for (int64_t d : sizes) n *= d;
  return n;
}

std::vector<int64_t> Placement::partition_weights() const {
  if (!split) return weights;
  std::vector<int64_t> w(weights.size(), 0);
  for (size_t i = 0; i < w.size(); ++i) w[i] = whole_kind[i] ? weights[i] : 0;
  return w;
}

// Note [Split parameters]
// With an element-wise optimizer (each element's update reads only that element's gradient and
// state: Adam, AdamW, SGD, RMSprop, Adagrad, or one registered as element-wise) the trainable run
// of each flat group is cut into row buckets, each into world_size equal rows (FlatLayout's split
// mode, Note [Row buckets]), so every rank owns 1/world_size of every bucket, and of the state,
// however large one tensor is. A rank steps, for each range
// it owns, a tensor that views those elements of the parameter (the parameter itself when it
// owns all of it); its state lives in the store's slabs at the range's place in the shard. The
// ranges follow the trainable set: a layout for a new set gives new holdings at once
// (OSS::assign_holdings; the buckets reduce to the new owners), and the state follows at the
// next step(), or at the next collective that needs it (OSS::settle_state), when every rank is
// known to hold the same set; only ranges that change rank move. A frozen parameter's state is
// kept, cut across the ranks (Note [Kept state]). kAuto splits element-wise optimizers'
// parameters unless whole parameters balance within split_above_imbalance (default 0: always),
// and always when a whole-tensor optimizer (Muon) is in the OSS (Note [Ownership by kind]).
// Before row buckets, one contiguous range per owner made a split step slower (for the first
// half of backward every reduction went to one rank) and kAuto split only above 3%. A row bucket
// is reduce-scattered to every rank at once, and split steps then took as long as whole ones on
// the GPT-2 shape (docs/benchmarks-log.md has the interleaved runs).

// Note [Ownership by kind]
// Each parameter's optimizer says how its state may be cut (shardopt/optim/state_layout.h): an
// element-wise one's (Adam, SGD, ...) into ranges, a whole-tensor one's (Muon) not at all. In a
// split layout the element-wise parameters of each (device, dtype) form one flat group cut into
// equal ranges (Note [Split parameters]) and the whole-tensor ones another, whose row buckets
// hold each parameter whole in its owner's row (Note [Rows of whole parameters] in
// shardopt/optim/flat_layout.h), so neither constrains the other's cuts and both take one
// reduce-scatter and one all-gather per bucket. kAuto lays out a whole-tensor optimizer's
// parameters this way even with no element-wise optimizer beside it. The partition then places
// only the whole-tensor parameters, balancing the cost of their updates, not their bytes: Muon's
// Newton-Schulz iteration costs about m n min(m, n) per matrix (Note [Muon's cost]), so a square
// matrix costs far more than a flat one of the same bytes.
// Placement::weights holds each whole-tensor parameter's cost scaled so that all of them sum to their
// bytes (the cost's proportions, in the units of the element-wise parameters' bytes), so that in
// a whole-parameter layout (kWholeParameters) one partition can place both kinds. After a change
// of the trainable set the whole-tensor owners are re-balanced like whole parameters (Note
// [Rebalance after a freeze]), and a frozen matrix's state waits with its owner.
Placement place_params(const std::vector<ParamShape>& params, int world_size, PartitionMode mode,
                       double split_above_imbalance, bool all_registered) {
  SHARDOPT_CHECK(world_size >= 1, "placement needs a world size >= 1, got ", world_size);
  Placement p;
  const size_t n = params.size();
  p.whole_kind.assign(n, 0);
  p.weights.assign(n, 0);
  std::vector<uint8_t> trainable(n, 0);
  // Weights: bytes; a whole-tensor optimizer's parameters weigh their cost, scaled so that those
  // parameters' costs sum to their bytes. An optimizer shardopt does not know keeps whole
  // parameters, balanced by bytes.
  int64_t whole_bytes = 0;
  double whole_cost = 0;
  std::vector<double> cost(n, 0.0);
  bool all_known = all_registered, any_element_wise = false, any_whole_kind = false;
  for (size_t i = 0; i < n; ++i) {
    const auto& s = params[i];
    trainable[i] = s.trainable;
    p.weights[i] = s.numel() * static_cast<int64_t>(c10::elementSize(s.dtype));
    p.whole_kind[i] = !s.registered || s.whole_tensor;
    all_known = all_known && s.registered;
    if (s.registered) (s.whole_tensor ? any_whole_kind : any_element_wise) = true;
    if (!s.registered || !s.whole_tensor) continue;
    cost[i] = s.cost;
    SHARDOPT_CHECK(cost[i] >= 0 && std::isfinite(cost[i]), "the cost of parameter ", i, " (", sizes_text(s.sizes),
                   ") is ", cost[i], "; a registered cost must be finite and >= 0");
    whole_bytes += p.weights[i];
    whole_cost += cost[i];
  }
  if (whole_cost > 0) {
    for (size_t i = 0; i < n; ++i) {
      if (cost[i] > 0) {
        p.weights[i] = std::max<int64_t>(1, std::llround(cost[i] / whole_cost * static_cast<double>(whole_bytes)));
      }
    }
  }
  // Split or whole (Note [Ownership by kind]).
  Partition whole = Partition::balance(p.weights, world_size, trainable);
  switch (mode) {
    case PartitionMode::kAuto:
      p.whole_imbalance = whole.imbalance(p.weights, trainable);
      p.split = all_known && (any_whole_kind || (any_element_wise && p.whole_imbalance >= split_above_imbalance));
      break;
    case PartitionMode::kWholeParameters: p.split = false; break;
    case PartitionMode::kSplit:
      SHARDOPT_CHECK(all_known, "partition kSplit needs optimizers shardopt can move state for (Adam, AdamW, SGD, "
                     "RMSprop, Adagrad, Muon or a registered one); use kWholeParameters or kAuto for this one");
      p.split = true;
      break;
  }
  p.partition = p.split ? Partition::balance(p.partition_weights(), world_size, trainable) : std::move(whole);
  return p;
}

Partition repartition(const Partition& now, const std::vector<int64_t>& weights, const std::vector<uint8_t>& trainable,
                      const std::vector<uint8_t>& kept, double threshold) {
  const double before = now.imbalance(weights, trainable);
  Partition next = now;
  if (before > threshold) {
    Partition balanced = Partition::rebalance(now, weights, trainable);
    if (balanced.imbalance(weights, trainable) < before) next = std::move(balanced);
  }
  // The state of frozen parameters spreads too, so that every rank holds its share in all (Note
  // [Kept state]); the trainable balance stays as decided.
  if (next.held_imbalance(weights, trainable, kept) > kKeptImbalance) {
    next = Partition::spread_kept(next, weights, trainable, kept);
  }
  return next;
}

std::vector<LayoutParam> layout_params(const std::vector<ParamShape>& params, const Partition& partition,
                                       const std::vector<uint8_t>& trainable, const std::vector<uint8_t>& stepped,
                                       const std::vector<uint8_t>& whole_kind) {
  std::vector<LayoutParam> specs;
  specs.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    LayoutParam p;
    p.device = params[i].device;
    p.dtype = params[i].dtype;
    p.numel = params[i].numel();
    p.owner = partition.owner(i);
    p.trainable = trainable.at(i) != 0;
    p.keeps_state = !p.trainable && i < stepped.size() && stepped[i];
    p.whole = i < whole_kind.size() && whole_kind[i];
    specs.push_back(p);
  }
  return specs;
}

std::optional<std::vector<std::pair<int, Range>>> held_ranges(const FlatLayout& layout, const Partition& partition,
                                                              bool kept_whole, bool trainable, size_t param,
                                                              int64_t numel) {
  std::vector<std::pair<int, Range>> held;
  if (kept_whole) {
    held.emplace_back(partition.owner(param), Range{0, numel});
  } else if (trainable) {
    for (size_t k : layout.pieces_of(param)) held.emplace_back(layout.pieces()[k].owner, layout.pieces()[k].in_param);
  } else if (!layout.keepers_of(param).empty()) {
    for (const Keeping& k : layout.keepers_of(param)) held.emplace_back(k.rank, k.in_param);
  } else {
    return std::nullopt;
  }
  return held;
}

int64_t bucket_memory_numel(const FlatBucket& bucket) {
  constexpr int64_t kAlign = 16;  // elements
  const int64_t elements = bucket.numel() + bucket.owned_pieces();
  return (elements + kAlign - 1) / kAlign * kAlign;
}

}  // namespace shardopt
