#include "shard_plan.h"

#include "units.h"

#include <shardopt/check.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>
#include <shardopt/optim/placement.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace shardopt::app {

namespace {

bool is_bf16(const std::string& mode) { return mode.size() > 5 && mode.compare(mode.size() - 5, 5, "-bf16") == 0; }

PartitionMode partition_mode(const std::string& name) {
  if (name == "auto") return PartitionMode::kAuto;
  if (name == "split") return PartitionMode::kSplit;
  SHARDOPT_CHECK(name == "whole", "--partition '", name, "' is not one of auto, split, whole");
  return PartitionMode::kWholeParameters;
}

// Note [Plan traffic]
// Per collective of B bytes over k ranks, the bytes each rank sends and receives under NCCL's
// algorithms: an all-reduce (ring) 2(k-1)/k B both ways on every rank; a reduce-scatter or an
// all-gather of a row bucket (ring) (k-1)/k B both ways on every rank; a reduce to an owner
// (chain ending at the owner) B sent by every rank but the owner, B received by every rank but
// the one after it, where the chain starts; a broadcast from an owner (chain starting there) B
// received by every rank but the owner, B sent by every rank but the last of the chain. Latency
// and overlap are left out: these are the bytes a step must move, not its time.
struct Traffic {
  std::vector<RankPlan>& ranks;
  bool across = false;
  void add(int rank, double sent, double received) {
    (across ? ranks[rank].sent_across : ranks[rank].sent_block) += sent;
    (across ? ranks[rank].received_across : ranks[rank].received_block) += received;
  }
  // `count` all-reduces of `bytes` in all.
  void all_reduce(double bytes, int k, int64_t count = 1) {
    if (k <= 1) return;
    const double each = 2.0 * (k - 1) / k * bytes;
    for (size_t r = 0; r < ranks.size(); ++r) {
      add(static_cast<int>(r), each, each);
      (across ? ranks[r].allreduces_across : ranks[r].allreduces_block) += count;
    }
  }
  void reduce(double bytes, int owner) {
    const int k = static_cast<int>(ranks.size());
    if (k == 1) return;
    for (int r = 0; r < k; ++r) {
      add(r, r == owner ? 0.0 : bytes, r == (owner + 1) % k ? 0.0 : bytes);
      ++ranks[r].chains_block;
    }
  }
  // A reduce-scatter or all-gather of a row bucket of `bytes` (all rows), on a ring.
  void rows(double bytes) {
    const int k = static_cast<int>(ranks.size());
    if (k == 1) return;
    const double each = static_cast<double>(k - 1) / k * bytes;
    for (int r = 0; r < k; ++r) {
      add(r, each, each);
      ++ranks[r].chains_block;
    }
  }
  void broadcast(double bytes, int owner) {
    const int k = static_cast<int>(ranks.size());
    if (k == 1) return;
    for (int r = 0; r < k; ++r) {
      add(r, r == (owner + k - 1) % k ? 0.0 : bytes, r == owner ? 0.0 : bytes);
      ++ranks[r].chains_block;
    }
  }
};

// The all-reduces of DDP's buckets for `bytes` of gradients, at PyTorch DDP's defaults: a first
// bucket of 1 MiB (dist._DEFAULT_FIRST_BUCKET_BYTES), then bucket_cap_mb = 25 MiB each.
int64_t ddp_buckets(double bytes) {
  constexpr double kFirst = 1 << 20, kCap = 25.0 * (1 << 20);
  if (bytes <= 0) return 0;
  return 1 + static_cast<int64_t>(std::ceil(std::max(0.0, bytes - kFirst) / kCap));
}

// The per-rank figures of `layout` for the parameters `shapes`: what OSS and ShardedDDP hold after
// steps under `trainable` with every parameter stepped.
void fill_ranks(ScenarioPlan& out, const PlanConfig& c, const FlatLayout& layout, const Placement& placement,
                const Partition& partition, const std::vector<ParamShape>& shapes, const std::vector<int>& state_per_element,
                const std::vector<uint8_t>& trainable, int64_t all_trainable_numel) {
  const int blocks = c.world_size / layout.world_size();
  const bool bf16 = is_bf16(c.mode), zero2 = c.mode.rfind("zero2", 0) == 0;
  const double low = bf16 ? 2.0 : 4.0;
  // ZeRO-2's gradients within a block travel in bf16 under --gradient-wire bf16 (Note [Gradient
  // wire] in csrc/comm/wire.cpp); the all-reduce across blocks stays exact.
  // int8: a byte an element and a 4-byte scale a block of 256 (Note [Int8 wire]).
  auto on_wire = [low](const std::string& wire) {
    return wire == "bf16" ? std::min(low, 2.0) : wire == "int8" ? std::min(low, 1.0 + 4.0 / 256) : low;
  };
  const double wire = on_wire(c.gradient_wire);
  // The parameter sync travels in bf16 or int8 under --param-wire, and the owners then keep fp32
  // masters of what they own (Note [Parameter wire]).
  const bool param_wire = c.param_wire != "exact" && c.mode != "ddp";
  const double sync = param_wire ? on_wire(c.param_wire) : low;
  // The state of `n` elements of a parameter of `numel`: fp32, bf16 under --state-format bf16 (Note
  // [State formats]), under int8 a byte an element and an fp32 scale a block for parameters of at
  // least kInt8StateMinNumel elements (a range starts on a block boundary: Note [8-bit state
  // slabs]); masters stay fp32.
  auto state_bytes = [&c](int64_t numel, double n) {
    if (c.state_format == "bf16") return 2.0 * n;
    if (c.state_format == "int8" && numel >= kInt8StateMinNumel) {
      return n + std::ceil(n / static_cast<double>(kInt8StateBlock)) * 4.0;
    }
    return 4.0 * n;
  };
  out.ranks.assign(layout.world_size(), RankPlan());
  for (int r = 0; r < layout.world_size(); ++r) out.ranks[r].rank = r;
  double buffers = 0;
  for (const auto& g : layout.groups()) buffers += static_cast<double>(g.buffer_numel()) * low;
  for (auto& r : out.ranks) r.params = buffers;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto held = held_ranges(layout, partition, placement.kept_whole(i), trainable[i] != 0, i, shapes[i].numel());
    if (!held) continue;  // frozen without state (never stepped): nothing held
    for (const auto& [rank, range] : *held) {
      const auto n = static_cast<double>(range.size());
      out.ranks[rank].state += state_per_element[i] * state_bytes(shapes[i].numel(), n);
      if (bf16 || param_wire) out.ranks[rank].masters += n * 4.0;
    }
  }
  int64_t trainable_numel = 0;
  for (size_t i = 0; i < shapes.size(); ++i) trainable_numel += trainable[i] ? shapes[i].numel() : 0;
  Traffic block{out.ranks, false}, across{out.ranks, true};
  if (zero2) {
    std::vector<double> owned(out.ranks.size(), 0.0);
    for (const auto& piece : layout.pieces()) {
      if (piece.bucket >= 0) out.ranks[piece.owner].grads += static_cast<double>(piece.in_param.size()) * low;
    }
    for (size_t k = 0; k < layout.buckets().size(); ++k) {
      const FlatBucket& b = layout.buckets()[k];
      if (b.rows()) {  // every rank owns a row (Note [Row buckets]), memory where it holds a piece
        for (size_t r = 0; r < owned.size(); ++r) {
          if (layout.holds_piece_of(k, static_cast<int>(r))) {
            out.ranks[r].buckets += static_cast<double>(bucket_memory_numel(b)) * low;
          }
          owned[r] += static_cast<double>(b.numel()) * low;
        }
        block.rows(static_cast<double>(b.numel() * layout.world_size()) * wire);
        continue;
      }
      out.ranks[b.owner].buckets += static_cast<double>(bucket_memory_numel(b)) * low;
      owned[b.owner] += static_cast<double>(b.numel()) * low;
      block.reduce(static_cast<double>(b.numel()) * wire, b.owner);
    }
    for (auto& r : out.ranks) r.buckets -= r.grads;  // the slabs' bytes beyond the gradients
    // Error feedback: a bf16 residual per element this rank sends, its own row's included (Note
    // [Error feedback] in csrc/ddp/reduction.cpp): the buckets' gradient elements, gaps too.
    if (c.error_feedback && c.gradient_wire != "exact" && layout.world_size() > 1) {  // one rank sends nothing
      double sent = 0;
      for (const auto& b : layout.buckets()) sent += static_cast<double>(b.rows() ? b.numel() * layout.world_size() : b.numel());
      for (auto& r : out.ranks) r.feedback = sent * 2.0;
    }
    // The replica groups all-reduce each owned, block-reduced bucket.
    if (blocks > 1) {
      for (size_t r = 0; r < owned.size(); ++r) {
        const double each = 2.0 * (blocks - 1) / blocks * owned[r];
        across.add(static_cast<int>(r), each, each);
      }
      for (const auto& b : layout.buckets()) {
        for (size_t r = 0; r < owned.size(); ++r) {
          if (b.rows() || static_cast<int>(r) == b.owner) ++out.ranks[r].allreduces_across;
        }
      }
    }
  } else {
    // DDP's all-reduce of every trainable gradient over the whole group, in DDP's buckets (their
    // memory counted as one buffer of the gradients' size).
    for (auto& r : out.ranks) {
      r.grads = static_cast<double>(trainable_numel) * low;
      r.buckets = static_cast<double>(std::max(all_trainable_numel, trainable_numel)) * low;
    }
    const double reduced = static_cast<double>(trainable_numel) * low;
    (blocks > 1 ? across : block).all_reduce(reduced, c.world_size, ddp_buckets(reduced));
  }
  // The parameter sync: each bucket's range of the parameters from its owner (a row bucket: its
  // rows from theirs).
  if (c.mode != "ddp") {
    for (const auto& b : layout.buckets()) {
      if (b.rows()) {
        block.rows(static_cast<double>(b.numel() * layout.world_size()) * sync);
      } else {
        block.broadcast(static_cast<double>(b.numel()) * sync, b.owner);
      }
    }
  }
  out.split = layout.options().split();
  out.buckets = layout.buckets().size();
  out.layout_imbalance = layout.imbalance();
  out.trainable = trainable_numel;
}

// Plain data parallel: every rank holds everything; the optimizer's state for every parameter.
void fill_ddp(ScenarioPlan& out, const PlanConfig& c, const std::vector<ParamShape>& shapes,
              const std::vector<int>& state_per_element, const std::vector<uint8_t>& trainable, int64_t all_numel) {
  RankPlan r;
  int64_t numel = 0, trainable_numel = 0;
  for (size_t i = 0; i < shapes.size(); ++i) {
    numel += shapes[i].numel();
    trainable_numel += trainable[i] ? shapes[i].numel() : 0;
    r.state += static_cast<double>(shapes[i].numel()) * state_per_element[i] * 4.0;
  }
  r.params = 4.0 * static_cast<double>(numel);
  r.grads = 4.0 * static_cast<double>(trainable_numel);
  r.buckets = 4.0 * static_cast<double>(std::max(all_numel, trainable_numel));
  out.ranks.assign(1, r);
  const double reduced = 4.0 * static_cast<double>(trainable_numel);
  Traffic{out.ranks, false}.all_reduce(reduced, c.world_size, ddp_buckets(reduced));
  out.ranks.assign(c.world_size, out.ranks.front());
  for (int k = 0; k < c.world_size; ++k) out.ranks[k].rank = k;
  out.trainable = trainable_numel;
}

}  // namespace

std::vector<uint8_t> freeze_leading(const ModelSpec& spec, double fraction, int64_t* frozen_numel) {
  std::vector<uint8_t> trainable(spec.layers.size(), 1);
  const auto numel = static_cast<double>(spec.numel());
  int64_t frozen = 0;
  for (size_t i = 0; i < spec.layers.size(); ++i) {
    int64_t n = 1;
    for (int64_t d : spec.layers[i].shape) n *= d;
    if (static_cast<double>(frozen + n) > fraction * numel) break;
    trainable[i] = 0;
    frozen += n;
  }
  if (frozen_numel) *frozen_numel = frozen;
  return trainable;
}

namespace {

// Errors name the option.
void check_config(const PlanConfig& c) {
  const std::vector<std::string> modes = {"ddp", "zero1", "zero2", "zero1-bf16", "zero2-bf16"};
  SHARDOPT_CHECK(std::find(modes.begin(), modes.end(), c.mode) != modes.end(), "--modes: '", c.mode,
                 "' is not one of ddp, zero1, zero2, zero1-bf16, zero2-bf16");
  SHARDOPT_CHECK(c.world_size >= 1, "--world-sizes: ", c.world_size, " is not a positive world size");
  SHARDOPT_CHECK(c.shard_group_size >= 0 && (c.shard_group_size == 0 || c.world_size % c.shard_group_size == 0),
                 "--shard-group-size ", c.shard_group_size, " does not divide the world size ", c.world_size);
  SHARDOPT_CHECK(c.optimizer == "adam" || c.optimizer == "muon", "--optimizer '", c.optimizer,
                 "' is not one of adam, muon");
  SHARDOPT_CHECK(c.bucket_bytes >= 0, "--bucket-mb must be >= 0");
  SHARDOPT_CHECK(c.freeze_fraction >= 0 && c.freeze_fraction < 1, "--freeze-fraction must be in [0, 1), got ",
                 c.freeze_fraction);
}

// The model's parameters as OSS sees them under `c`, and the fp32 state elements each element of
// them holds (Muon: momentum_buffer; Adam: exp_avg, exp_avg_sq).
std::vector<ParamShape> shapes_of(const ModelSpec& spec, const PlanConfig& c, std::vector<int>& state_per_element) {
  const bool bf16 = is_bf16(c.mode);
  std::vector<ParamShape> shapes;
  for (const auto& layer : spec.layers) {
    ParamShape s;
    s.sizes = layer.shape;
    s.dtype = bf16 ? c10::kBFloat16 : c10::kFloat;
    const bool muon = c.optimizer == "muon" && muon_matrix(layer);
    s.whole_tensor = muon;
    s.cost = muon ? muon_cost(s.sizes) : 0.0;
    shapes.push_back(std::move(s));
    state_per_element.push_back(muon ? 1 : 2);
  }
  return shapes;
}

}  // namespace

std::vector<ScenarioPlan> plan_config(const ModelSpec& spec, const PlanConfig& c) {
  check_config(c);
  std::vector<int> state_per_element;
  const std::vector<ParamShape> shapes = shapes_of(spec, c, state_per_element);
  const int64_t all_numel = spec.numel();
  std::vector<uint8_t> all(shapes.size(), 1), none(shapes.size(), 0);
  int64_t frozen_numel = 0;
  const std::vector<uint8_t> frozen_set = freeze_leading(spec, c.freeze_fraction, &frozen_numel);
  SHARDOPT_CHECK(c.freeze_fraction <= 0 || frozen_numel > 0, "--freeze-fraction ", c.freeze_fraction,
                 " freezes no layer: the first, '", spec.layers.front().name, "', is alone more than that fraction of the model");
  std::vector<ScenarioPlan> out(1);
  out[0].scenario = "all trainable";
  if (c.freeze_fraction > 0) {
    out.emplace_back();
    out[1].scenario = fmt::format("{:.0f}% frozen", 100.0 * static_cast<double>(frozen_numel) / static_cast<double>(all_numel));
  }
  if (c.mode == "ddp") {
    fill_ddp(out[0], c, shapes, state_per_element, all, all_numel);
    if (out.size() > 1) fill_ddp(out[1], c, shapes, state_per_element, frozen_set, all_numel);
    return out;
  }
  // OSS's construction (OSS::init) over one block, then ShardedDDP's buckets.
  const int shard_world = c.shard_group_size > 0 ? c.shard_group_size : c.world_size;
  const Placement placement =
      place_params(shapes, shard_world, partition_mode(c.partition), OSSOptions().split_above_imbalance(), true);
  LayoutOptions options = OSSOptions().layout();
  if (c.state_format == "int8") options.align(kInt8StateBlock);  // as OSS::init aligns it
  // ZeRO-2: ShardedDDP's buckets, which grow with the world size; ZeRO-1: OSS's own layout.
  const int64_t bucket_bytes = ShardedDDPOptions().reduce_bucket_bytes(c.bucket_bytes).bucket_bytes_for(c.world_size);
  options.split(placement.split).bucket_bytes(c.mode.rfind("zero2", 0) == 0 ? bucket_bytes : 0);
  const FlatLayout first = FlatLayout::plan(layout_params(shapes, placement.partition, all, none, placement.whole_kind),
                                            shard_world, options);
  fill_ranks(out[0], c, first, placement, placement.partition, shapes, state_per_element, all, all_numel);
  if (out.size() == 1) return out;
  // After steps every parameter has state; the frozen ones keep it (Note [Kept state]), and OSS
  // re-partitions what stays whole (Note [Rebalance after a freeze]).
  Partition partition = placement.partition;
  bool any_whole = !placement.split;
  for (uint8_t w : placement.whole_kind) any_whole = any_whole || w;
  std::vector<uint8_t> kept(shapes.size(), 0);
  for (size_t i = 0; i < shapes.size(); ++i) kept[i] = !frozen_set[i];
  if (shard_world > 1 && any_whole && OSSOptions().rebalance()) {
    partition = repartition(partition, placement.partition_weights(), frozen_set, kept, OSSOptions().rebalance_threshold());
  }
  const FlatLayout after = FlatLayout::plan(layout_params(shapes, partition, frozen_set, all, placement.whole_kind),
                                            shard_world, options);
  fill_ranks(out[1], c, after, placement, partition, shapes, state_per_element, frozen_set, all_numel);
  return out;
}

}  // namespace shardopt::app
