// The store's parameter buffers: laid out for the partition and the trainable set, and made
// current on every rank after the step (Note [Parameter sync], Note [Overlapped parameter sync]).
#include "optim/param_buffers.h"
#include "optim/buffer_moves.h"
#include "optim/shard_store.h"

#include <shardopt/optim/placement.h>

#include <shardopt/check.h>
#include <shardopt/optim/oss.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <optional>

namespace shardopt::detail {

namespace {

size_t group_of(const FlatLayout& layout, size_t param) { return layout.pieces()[layout.pieces_of(param).front()].group; }

// Where `old` (one of the buffers before) can hold new group `g` in place: it holds exactly the
// group's parameters, as contiguous views, with the group's device and dtype, and has room for
// the group's buffer. Then the parameters' moves within it; else nothing.
std::optional<std::vector<RangeMove>> moves_in_place(const FlatLayout& layout, const std::vector<at::Tensor>& params,
                                                     size_t g, const std::vector<size_t>& members,
                                                     const at::Tensor& old, size_t old_members, int64_t room) {
  const FlatGroup& group = layout.groups()[g];
  if (!old.defined() || members.size() != old_members || old.scalar_type() != group.dtype ||
      old.device() != group.device || old.storage_offset() != 0 || room < group.buffer_numel() * old.element_size()) {
    return std::nullopt;
  }
  std::vector<RangeMove> moves;
  for (size_t i : members) {
    const at::Tensor& p = params[i];
    if (!p.is_contiguous() || !p.storage().is_alias_of(old.storage())) return std::nullopt;
    moves.push_back({p.storage_offset(), layout.param_in_buffer(i).begin, p.numel()});
  }
  return moves;
}

}  // namespace

std::vector<at::Tensor> lay_out_params(const FlatLayout& layout, std::vector<at::Tensor>& params,
                                       std::vector<at::Tensor> old, std::vector<int64_t>* room) {
  TORCH_INTERNAL_ASSERT(layout.num_params() == params.size(), "layout of ", layout.num_params(), " parameters for ",
                        params.size());
  at::NoGradGuard no_grad;
  const size_t groups = layout.groups().size();
  std::vector<std::vector<size_t>> members(groups);
  for (size_t i = 0; i < params.size(); ++i) {
    TORCH_INTERNAL_ASSERT(layout.param_in_buffer(i).size() == params[i].numel(), "parameter ", i, " has ",
                          params[i].numel(), " elements, its range ", layout.param_in_buffer(i).size());
    members[group_of(layout, i)].push_back(i);
  }
  // Each old buffer holds the parameters of at most one new group: the one of its first.
  std::vector<size_t> old_members(old.size(), 0);
  std::vector<int64_t> old_of(groups, -1);
  for (size_t i = 0; i < params.size(); ++i) {
    for (size_t k = 0; k < old.size(); ++k) {
      if (!params[i].storage().is_alias_of(old[k].storage())) continue;
      ++old_members[k];
      if (old_of[group_of(layout, i)] < 0) old_of[group_of(layout, i)] = static_cast<int64_t>(k);
    }
  }
  std::vector<at::Tensor> buffers(groups);
  std::vector<int64_t> rooms(groups, 0);
  for (size_t g = 0; g < groups; ++g) {
    const FlatGroup& group = layout.groups()[g];
    const int64_t k = old_of[g];
    const int64_t old_room = k < 0 ? 0 : room && static_cast<size_t>(k) < room->size() ? (*room)[k]
                                                                                         : static_cast<int64_t>(old[k].storage().nbytes());
    const auto moves = k < 0 ? std::nullopt : moves_in_place(layout, params, g, members[g], old[k], old_members[k], old_room);
    if (moves) {  // Note [Moving ranges in place]
      at::Tensor& from = old[k];
      const at::Tensor whole = storage_as(from, old_room);  // all of its memory, for the moves
      int64_t span = group.buffer_numel();  // the new buffer, and the old places beyond it
      for (const auto& m : *moves) span = std::max(span, m.from + m.numel);
      move_ranges_in_place(whole.narrow(0, 0, span), *moves);
      // The storage counts the buffer's bytes; its memory keeps its room.
      buffers[g] = storage_as(from, group.buffer_numel() * static_cast<int64_t>(from.element_size()));
      rooms[g] = old_room;
      from = at::Tensor();
    } else {
      buffers[g] = zeros_with_room(group.buffer_numel(), at::TensorOptions().dtype(group.dtype).device(group.device),
                                   rooms[g]);
    }
  }
  if (room) *room = std::move(rooms);
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    // A parameter's pieces are adjacent: it stays one view, whatever its owners.
    const Range at = layout.param_in_buffer(i);
    at::Tensor view = buffers[group_of(layout, i)].narrow(0, at.begin, at.size()).view(p.sizes());
    if (!view.is_alias_of(p) || view.storage_offset() != p.storage_offset()) {
      if (!view.storage().is_alias_of(p.storage())) view.copy_(p.detach());  // a new buffer: the values copied in
      p.set_data(view);
    }
  }
  return buffers;
}

at::Tensor bucket_rows(const FlatLayout& layout, std::vector<at::Tensor>& buffers, size_t bucket) {
  const FlatBucket& b = layout.buckets().at(bucket);
  TORCH_INTERNAL_ASSERT(b.rows(), "bucket ", bucket, " is not a row bucket");
  const Range r = b.rows_in_buffer(layout.world_size());
  return buffers[b.group].narrow(0, r.begin, r.size());
}

namespace {

const at::Tensor& own_row(const std::vector<at::Tensor>& own_rows, size_t bucket) {
  static const at::Tensor none;
  return bucket < own_rows.size() ? own_rows[bucket] : none;
}

}  // namespace

void sync_params(ProcessGroup& group, const FlatLayout& layout, std::vector<at::Tensor>& buffers, ParamSync mode,
                 Wire wire, const std::vector<at::Tensor>& own_rows) {
  const int world = group.size();
  if (world == 1) return;
  at::NoGradGuard no_grad;
  std::vector<PendingWork> pending;
  // Row groups: one all-gather per row bucket, whatever `mode` (Note [Row buckets]).
  for (size_t b = 0; b < layout.buckets().size(); ++b) {
    if (!layout.buckets()[b].rows()) continue;
    at::Tensor rows = bucket_rows(layout, buffers, b);
    pending.push_back(group.allgather_rows_async(rows, wire_dtype(wire, rows.scalar_type()), own_row(own_rows, b),
                                                 layout.buckets()[b].row_used));
  }
  if (mode == ParamSync::kBroadcast) {
    auto shard = [&](size_t g, int owner) {
      const Range r = layout.groups()[g].shard_in_buffer(owner);
      return buffers[g].narrow(0, r.begin, r.size());
    };
    for (size_t g = 0; g < buffers.size(); ++g) {
      if (layout.groups()[g].rows) continue;
      for (int r = 0; r < world; ++r) {
        // Only the elements the owner's pieces occupy: a whole-parameter shard's padding up to
        // the longest shard is never sent.
        const int64_t used = layout.groups()[g].used[r];
        if (used == 0) continue;
        at::Tensor segment = shard(g, r).narrow(0, 0, used);
        pending.push_back(group.broadcast_async(segment, r, wire_dtype(wire, segment.scalar_type())));
      }
    }
    for (auto& w : pending) w.wait();
    return;
  }
  for (size_t g = 0; g < buffers.size(); ++g) {
    if (layout.groups()[g].rows) continue;
    at::Tensor rows = shards_as_rows(layout, buffers, g);
    if (rows.numel() > 0) pending.push_back(group.allgather_rows_async(rows, wire_dtype(wire, rows.scalar_type())));
  }
  for (auto& w : pending) w.wait();
}

at::Tensor shards_as_rows(const FlatLayout& layout, std::vector<at::Tensor>& buffers, size_t g) {
  const FlatGroup& group = layout.groups()[g];
  TORCH_INTERNAL_ASSERT(!group.rows, "a row group's shards are the rows of its row buckets");
  const Range first = group.shard_in_buffer(0);
  return buffers[g].narrow(0, first.begin, first.size() * layout.world_size());
}

ShardStore::ShardStore(std::vector<at::Tensor> params, std::shared_ptr<ProcessGroup> group, LayoutOptions options,
                       ParamSync sync, Wire wire, Partition partition, std::vector<uint8_t> kept_whole)
    : params_(std::move(params)),
      group_(std::move(group)),
      layout_options_(options),
      sync_(sync),
      wire_(wire),
      kept_whole_(std::move(kept_whole)),
      stepped_(params_.size(), 0) {
  auto first = std::make_shared<ShardPlan>();
  first->partition = std::move(partition);
  plan_ = std::move(first);
}

PlanPtr ShardStore::make_plan(std::vector<uint8_t> trainable, Partition partition) const {
  SHARDOPT_CHECK(trainable.size() == params_.size(), "a plan got ", trainable.size(), " trainable flags for ",
                 params_.size(), " parameters");
  std::vector<ParamShape> shapes;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& p = params_[i];
    SHARDOPT_CHECK(p.device().is_cpu() || p.device().is_cuda(), "parameter ", i, " is on ", p.device(),
                   "; OSS supports CPU and CUDA parameters");
    ParamShape shape;
    shape.sizes = p.sizes().vec();
    shape.dtype = p.scalar_type();
    shape.device = p.device();
    shapes.push_back(std::move(shape));
  }
  auto plan = std::make_shared<ShardPlan>();
  plan->layout = FlatLayout::plan(layout_params(shapes, partition, trainable, stepped_, kept_whole_), group_->size(),
                                  layout_options_);
  plan->trainable = std::move(trainable);
  plan->partition = std::move(partition);
  plan->version = plan_->version + 1;
  return plan;
}

bool ShardStore::lay_out_for(const std::vector<uint8_t>& trainable) {
  if (trainable == plan_->trainable) return false;
  lay_out(make_plan(trainable, plan_->partition));
  return true;
}

void ShardStore::lay_out(PlanPtr plan) {
  TORCH_INTERNAL_ASSERT(plan && plan->version > plan_->version, "a plan older than the current one");
  finish_param_sync();  // the data moves to new buffers: it must be current first
  plan_ = std::move(plan);
  buffers_ = lay_out_params(plan_->layout, params_, std::move(buffers_), &buffer_room_);
}

void ShardStore::set_bucket_bytes(int64_t bytes) {
  SHARDOPT_CHECK(bytes >= 0, "bucket bytes must be >= 0, got ", bytes);
  if (bytes == layout_options_.bucket_bytes()) return;
  finish_param_sync();  // the in-flight work is indexed by the old buckets
  layout_options_.bucket_bytes(bytes);
  if (plan_->trainable.empty()) return;  // not laid out yet: the first layout takes the new cuts
  PlanPtr next = make_plan(plan_->trainable, plan_->partition);
  if (!next->layout.same_placement(plan_->layout)) {  // new row buckets move the data (Note [Row buckets])
    lay_out(std::move(next));
    return;
  }
  plan_ = std::move(next);  // new cuts over the same buffers
}

// Note [Overlapped parameter sync]
// After the step, each gradient bucket's range of the parameter buffer goes out from its owners:
// a row bucket's rows in one all-gather, a whole-parameter bucket broadcast from its owner. They
// are the ranges the owners just stepped (frozen parameters do not change). The buckets go out in reverse order: the trainable run holds the parameters in
// reverse order (Note [Bucket order]), so the last buckets hold the first layers, which the next
// forward needs first. ShardedDDP waits, before each child of a Sequential (or where the user
// calls wait_param_sync), only for the buckets of that child's parameters, so the rest of the
// sync runs beside the forward; without per-child waits it finishes everything in pre_forward.
// Anything that lays the buffers out again or reads the parameters here finishes it first.
void ShardStore::start_param_sync(const std::vector<at::Tensor>& own_rows) {
  CommPhase phase("step (parameter sync, overlapped)");
  const auto& buckets = layout().buckets();
  if (!step_sync_open_) begin_step_sync();
  if (sync_ == ParamSync::kAllgather) {
    // One all-gather of the shards' rows per flat buffer of whole parameters (Note [Rows]), all
    // in flight: a parameter is current once its buffer's has finished.
    group_sync_.resize(buffers_.size());
    for (size_t g = 0; g < buffers_.size(); ++g) {
      if (layout().groups()[g].rows) continue;
      at::Tensor rows = shards_as_rows(layout(), buffers_, g);
      if (rows.numel() == 0) continue;  // frozen only
      group_sync_[g] = group_->allgather_rows_async(rows, wire_dtype(wire_, rows.scalar_type()));
      ++sync_in_flight_;
    }
  }
  for (size_t k = buckets.size(); k-- > 0;) {
    if (started_[k] || (!buckets[k].rows() && sync_ == ParamSync::kAllgather)) continue;
    bucket_sync_[k] = start_sync_of(k, own_rows);
    ++sync_in_flight_;
  }
}

PendingWork ShardStore::start_sync_of(size_t bucket, const std::vector<at::Tensor>& own_rows) {
  const FlatBucket& b = layout().buckets()[bucket];
  PendingWork work;
  if (b.rows()) {  // an all-gather of the bucket's rows (Note [Row buckets])
    at::Tensor rows = bucket_rows(layout(), buffers_, bucket);
    work = group_->allgather_rows_async(rows, wire_dtype(wire_, rows.scalar_type()), own_row(own_rows, bucket),
                                        b.row_used);
  } else {
    const int64_t begin = layout().groups()[b.group].shard_in_buffer(b.owner).begin + b.in_shard.begin;
    at::Tensor range = buffers_[b.group].narrow(0, begin, b.numel());
    work = group_->broadcast_async(range, b.owner, wire_dtype(wire_, range.scalar_type()));
  }
  if (timeline::recording()) {
    work.on_timeline(timeline::Lane::kParameterSync,
                     "bucket " + std::to_string(bucket) + (b.rows() ? " all-gather" : " broadcast from rank " + std::to_string(b.owner)));
  }
  return work;
}

void ShardStore::note_completed_syncs() {
  for (auto& w : bucket_sync_) {
    if (w.valid()) w.completed();
  }
}

void ShardStore::begin_step_sync() {
  finish_param_sync();
  bucket_sync_.clear();
  group_sync_.clear();
  bucket_sync_.resize(layout().buckets().size());
  started_.assign(layout().buckets().size(), 0);
  step_sync_open_ = true;
}

void ShardStore::start_bucket_sync(size_t bucket, const std::vector<at::Tensor>& own_rows) {
  if (group_->size() == 1) return;
  CommPhase phase("step (parameter sync)");
  TORCH_INTERNAL_ASSERT(step_sync_open_, "start_bucket_sync outside a step (begin_step_sync)");
  const FlatBucket& b = layout().buckets().at(bucket);
  TORCH_INTERNAL_ASSERT(!started_[bucket], "bucket ", bucket, " already started");
  TORCH_INTERNAL_ASSERT(b.rows() || sync_ == ParamSync::kBroadcast, "bucket ", bucket,
                        " goes with its flat buffer's all-gather (ParamSync::kAllgather)");
  bucket_sync_[bucket] = start_sync_of(bucket, own_rows);
  started_[bucket] = 1;
  ++sync_in_flight_;
}

void ShardStore::sync_after_step(const std::vector<at::Tensor>& own_rows) {
  const bool started = std::find(started_.begin(), started_.end(), 1) != started_.end();
  if (group_->size() > 1 && (overlap_sync_ || (step_sync_open_ && started))) {
    start_param_sync(own_rows);
    if (!overlap_sync_) finish_param_sync();
  } else {
    sync_params(own_rows);
  }
  step_sync_open_ = false;
}

void ShardStore::sync_params(const std::vector<at::Tensor>& own_rows) {
  finish_param_sync();
  CommPhase phase("step (parameter sync)");
  detail::sync_params(*group_, layout(), buffers_, sync_, wire_, own_rows);
}

// Note [Syncing from the masters]
// Under a compressed parameter wire (Note [Parameter wire]) the owners step fp32 masters, which
// live in their group's master slab at their slots: for a row bucket, at the offsets of this
// rank's row (Note [State slabs]), with zeros in the gaps between pieces, as the parameter
// buffer has. So where every piece of this rank's row of a row bucket has its master there, the
// sync packs the row straight from the slab and sets the row of the parameters to what the others
// decode, in one pass (WireCodec::encode_rounding), and the step writes none of those masters
// back into the parameters first: one pass over the row fewer than writing back, then packing
// and rounding the parameters. Where the step stepped every piece of the row, the bits are those
// of writing back first; a piece it did not step (no gradient, or a step the gradient scaler
// skipped) is packed from its exact master, not from the rounded value its parameter holds, so
// every sync is a function of the masters alone. Elsewhere (a master of its own, an exact wire,
// parameters in another dtype than their masters, one rank) the step writes back as before.
MasterRows ShardStore::master_rows(const std::vector<std::vector<Holding>>& holdings, int rank,
                                   const std::vector<at::Tensor>& master_slabs) const {
  MasterRows out;
  const FlatLayout& lay = layout();
  if (group_->size() == 1 || wire_ == Wire::kExact || holdings.size() != lay.num_params()) return out;
  for (size_t k = 0; k < lay.buckets().size(); ++k) {
    const FlatBucket& b = lay.buckets()[k];
    if (!b.rows() || b.numel() == 0) continue;
    const at::Tensor& buffer = buffers_.at(b.group);
    const auto wire = wire_dtype(wire_, buffer.scalar_type());
    const at::Tensor masters = b.group < master_slabs.size() ? master_slabs[b.group] : at::Tensor();
    if (!wire || *wire == buffer.scalar_type() || !masters.defined() ||
        masters.scalar_type() != buffer.scalar_type() || masters.device() != buffer.device() ||
        masters.numel() < b.in_shard.end) {
      continue;
    }
    std::vector<const void*> held;
    bool all = true;
    for (size_t p : b.pieces) {
      const Piece& piece = lay.pieces()[p];
      if (piece.owner != rank) continue;
      const void* at = static_cast<const char*>(masters.const_data_ptr()) + piece.in_shard.begin * masters.element_size();
      auto it = std::find_if(holdings[piece.param].begin(), holdings[piece.param].end(), [&](const Holding& h) {
        return h.rank == rank && h.in_param == piece.in_param && h.tensor.defined() && h.tensor.is_contiguous() &&
               h.tensor.const_data_ptr() == at;
      });
      all = it != holdings[piece.param].end();
      if (!all) break;
      held.push_back(it->tensor.unsafeGetTensorImpl());
    }
    if (!all) continue;
    if (out.rows.empty()) out.rows.resize(lay.buckets().size());
    out.rows[k] = masters.narrow(0, b.in_shard.begin, b.numel());
    out.covered.insert(held.begin(), held.end());
  }
  return out;
}

void ShardStore::finish_param_sync() {
  if (sync_in_flight_ == 0) return;
  CommPhase phase("parameter sync (finishing)");
  for (size_t k = bucket_sync_.size(); k-- > 0;) {
    if (!bucket_sync_[k].valid()) continue;
    --sync_in_flight_;
    bucket_sync_[k].wait();
  }
  for (auto& w : group_sync_) {
    if (w.valid()) w.wait();
  }
  sync_in_flight_ = 0;
}

void ShardStore::finish_param_sync(size_t param) {
  if (sync_in_flight_ == 0) return;
  SHARDOPT_CHECK(param < params_.size(), "finish_param_sync: parameter ", param, " of ", params_.size());
  CommPhase phase("parameter sync (finishing)");
  for (size_t k : layout().pieces_of(param)) {
    const size_t g = layout().pieces()[k].group;
    if (!group_sync_.empty() && !layout().groups()[g].rows) {
      PendingWork& w = group_sync_[g];
      if (!w.valid()) continue;
      --sync_in_flight_;
      w.wait();
      continue;
    }
    const int64_t b = layout().pieces()[k].bucket;
    if (b < 0 || !bucket_sync_[b].valid()) continue;
    --sync_in_flight_;
    bucket_sync_[b].wait();
  }
}

void ShardStore::hand_over(const HandOver& h) {
  if (!h.overlap_param_sync) finish_param_sync();
  overlap_sync_ = h.overlap_param_sync;
  trainable_checked_outside_ = h.checks_trainable;
  step_in_backward_ = h.step_in_backward;
  handed_over_ = true;
  set_bucket_bytes(h.bucket_bytes);
}

void ShardStore::take_back() {
  trainable_checked_outside_ = false;
  handed_over_ = false;
  overlap_sync_ = false;
  step_in_backward_ = false;
  finish_param_sync();
}

}  // namespace shardopt::detail
