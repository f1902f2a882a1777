// ShardedDDP's backward: gradients into buckets, reductions to their owners overlapped with
// backward, and the reduced gradients handed over to the owners.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/check.h>

#include "ddp/executor.h"
#include "comm/wire_codec.h"

#include <algorithm>
#include <cstring>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <string>

namespace shardopt {

// Note [One gradient's path]
// From autograd to the optimizer, one trainable parameter's gradient under ShardedDDP + OSS
// passes these functions, in this order (each names its file; the Notes named say why):
//  1. Before autograd accumulates anything in a backward outside no_sync(), the parameter's
//     pre-hook runs ShardedDDP::before_accumulation (this file), whose first call runs
//     decide_bucket_views / decide_bucket_view (bucket_views.cpp): where the owner's gradient is
//     already its bucket's memory, autograd accumulates into the bucket (Note [Gradients as
//     bucket views]).
//  2. Autograd accumulates into p.grad and runs the post-accumulation hook, GradReadyHook
//     (sharded_ddp.cpp), which calls ShardedDDP::on_grad_ready: the first gradient of a backward
//     waits for the trainability check of the forward (await_mask_check, sharded_ddp.cpp) and
//     queues finish_reduction for the backward's end (Note [Reduction phases]); with
//     step_in_backward it also begins each OSS's step (begin_backward_steps, step_in_backward.cpp).
//  3. ShardedDDP::fill_param copies the gradient into its slot of each bucket holding it:
//     bucket_buffer makes the reduce buffer (the memory of the buckets sent to other owners from
//     take_scratch, reduce_scratch.cpp, Note [Reduce scratch]; a row bucket's own row is
//     owned_memory, the memory of GradSlabs::bucket_memory, grad_slabs.cpp), fill_small_on_host
//     or copy_ writes the slot, release_local_grad drops the local gradient (an owner keeps a
//     view of its slot).
//  4. ShardedDDP::launch_ready_buckets launches each bucket, in bucket order, once all its slots
//     are written: write_flags, feed_back_error on a rounding wire with error feedback (this
//     file, Note [Error feedback]; its residuals' checkpoints in error_feedback_state.cpp), then
//     ProcessGroup::reduce_scatter_rows_into_async for a row bucket (csrc/comm/rows.cpp, Note
//     [Rows]: on Gloo direct transfers summed by detail::sum_to, comm/sum_into.cpp, or the rounds
//     of comm/row_rounds.cpp; on NCCL its reduce-scatter) or reduce_async / reduce_mean_async to
//     the owner for a bucket of whole parameters (comm/process_group.cpp, Note [Reduce to one
//     owner]). On the bf16 and int8 wires the contributions are packed and summed by the codecs
//     of comm/wire.cpp and comm/on_wire.cpp (Note [Gradient wire], Note [Int8 wire]), with the
//     loops of comm/wire_kernels.inc.
//  5. At the backward's end, ShardedDDP::finish_reduction fills the parameters that had no
//     gradient (fill_param), launches the rest, waits for every bucket (PendingWork::wait), reads
//     the clearing evidence of split pieces (clearing_evidence), checks (reduction_error) and
//     calls hand_over_reduced: across blocks the replica all-reduce, the division, the flags, and
//     Entry::set_grad (executor.h) gives the owner its reduced gradient: a whole parameter's
//     p.grad() becomes a view of the reduced row (alias_at), a split range's goes to
//     ShardStore::set_grad (optim/shard_grads.cpp). reset_executor readies the next backward.
//     With step_in_backward, step_reduced_buckets (step_in_backward.cpp) hands each bucket over
//     as soon as its reduction is seen complete and its OSS steps it at once
//     (OSS::step_reduced_bucket, optim/oss_step_in_backward.cpp, Note [A step in the backward]).
//  6. OSS::step (optim/oss_step.cpp) runs step_with: settle_state (optim/oss.cpp) moves state for a
//     new plan (optim/state_migration.cpp); a ShardedGradScaler's unscale and found-inf check run
//     first (optim/grad_scaler.cpp), or in the step itself (Note [Unscaling in the step]).
//     step_shard reads each holding's gradient through OSS::holding_grad (optim/oss.cpp: the
//     whole p.grad(), a range of it, or ShardStore::grad) into detail::FusedStepInputs;
//     step_by_bucket (Note [A step per bucket]) hands each bucket's holdings to detail::fused_step
//     (optim/fused_step.cpp) and starts that bucket's sync (ShardStore::start_bucket_sync,
//     optim/param_buffers.cpp) before it steps the next. fused_step groups runs (adam_like_step),
//     joins adjacent tensors (joined_adjacent, optim/adjacent.h), then adam_kernel runs the CPU
//     loops of optim/fused_kernels.inc (adam_loop; adam8_loop for 8-bit state, which decodes,
//     updates and codes each block again in one pass), built per instruction set in
//     fused_kernels_*.cpp and chosen by fused_kernels_dispatch.cpp; mixed precision's masters
//     go through optim/fused_step_mixed.h and optim/master_weights.cpp, 8-bit state lives in the
//     slabs of optim/state_slabs.cpp with the maps of optim/state_codes.cpp; on
//     CUDA, detail::cuda_adam (cuda/kernels_adapter.cpp) and shardopt_adamw_fp32_segments
//     (kernels/). An optimizer the fused step does not take (Muon, optim/muon.cpp, or a user's
//     own) steps through its torch::optim step instead. ShardStore::sync_after_step
//     (optim/param_buffers.cpp) then sends what is left to every rank (allgather_rows_async,
//     Note [Overlapped parameter sync]).

using detail::alias_at;

// Note [Accumulating across reductions]
// DDP's result for two backward passes without clearing is the first averaged gradient plus the
// second. A non-owner drops its gradient once it is reduced, so the sum cannot be formed by
// reducing what autograd accumulated (the owner's reduced gradient would be divided by the world
// size again). Instead, just before autograd accumulates into a parameter (a tensor hook), an
// owner's gradient that is still the one the last reduction handed over (the same tensor: not
// cleared, perhaps zeroed or scaled in place) is set aside; the backward reduces fresh gradients
// and the two are added. An owner that gets no local gradient does the same when the reduction
// is handed over. A split parameter's pieces live on tensors of their own, which the user's
// clearing (module->zero_grad(), p.grad() edits) does not reach, so a piece cannot show whether
// it was cleared. The owners of whole parameters can: a gradient left exactly as handed over
// (the same tensor, its version unchanged) means the habit, a cleared or zeroed one means not.
// With split parameters every rank learns what those owners saw (one small all-reduce at the end
// of backward), and a piece still holding the last reduction carries it over when gradients were
// left uncleared. Where no rank holds a whole parameter's handed-over gradient to look at, the
// two cannot be told apart, and that is an error on every rank, never a silent divergence.
bool ShardedDDP::is_handed_over(const Entry& e) const {
  if (!e.owned) return false;
  const at::Tensor& g = e.grad();
  return g.defined() && e.handed_over && !e.handed_over->expired() &&
         e.handed_over->_unsafe_get_target() == g.unsafeGetTensorImpl();
}

// Runs before autograd accumulates this backward's gradient into the parameter: an owner's
// gradient still as the last reduction handed it over is set aside, so that the reduction of
// this backward's fresh gradients can be added to it.
void ShardedDDP::before_accumulation(size_t h) {
  if (phase_ == Phase::kIdle && !no_sync_) decide_bucket_views();
  for (size_t k : hooked_[h].entries) {
    Entry& e = entries_[k];
    if (!e.whole || !e.owned || !is_handed_over(e)) continue;
    // Zeroed where the bucket is (decide_bucket_views): autograd adds into its slot.
    const Bucket& b = buckets_[e.bucket];
    if (b.in_place && e.grad().storage().unsafeGetStorageImpl() == b.owned_slots().storage().unsafeGetStorageImpl()) {
      continue;
    }
    // Stepped in the last backward already (Note [A step in the backward]): replaced, not added to.
    if (!options_.step_in_backward()) {
      uncleared_ |= static_cast<int64_t>(e.grad()._version()) == e.handed_version;
      e.carried = e.grad();
    }
    e.set_grad(at::Tensor());
  }
}

// ---- backward -----------------------------------------------------------------------------------

// Note [Reduction phases]
// Where the reduction stands is one value, ShardedDDP::phase_:
//   kIdle          no backward under way, and no local gradient waits to be reduced.
//   kViews         a backward outside no_sync() began with nothing waiting: before autograd
//                  accumulated anything, decide_bucket_views() chose which buckets are the
//                  gradients' own memory (Note [Gradients as bucket views]). The first ready
//                  gradient moves on to kReducing; a backward that readies none (autograd::grad)
//                  drops the decision at its end and goes back to kIdle.
//   kAccumulating  backward(s) under no_sync() left local, unreduced gradients. The next backward
//                  outside no_sync() (or reduce()) reduces them with its own, deciding no views;
//                  the trainable set may not change meanwhile.
//   kReducing      a backward outside no_sync() has a ready gradient: buckets are filled and
//                  launched as they complete, and finish_reduction(), queued to run when autograd
//                  is done, waits for them, hands the results over and returns to kIdle. A
//                  backward that raised in between stays here, and the next forward refuses to
//                  pair this rank's collectives with the wrong ones elsewhere.
// no_sync() itself is a mode the user sets, not a phase.

void ShardedDDP::on_grad_ready(size_t h) {
  CommPhase phase("backward (gradient reductions)");
  if (no_sync_) {
    phase_ = Phase::kAccumulating;
    return;
  }
  if (phase_ != Phase::kReducing) {
    await_mask_check();
    phase_ = Phase::kReducing;
    torch::autograd::Engine::get_default_engine().queue_callback([this] { finish_reduction(); });
    if (options_.step_in_backward()) begin_backward_steps();
  }
  fill_param(h);
  launch_ready_buckets();
  if (stepping_) step_reduced_buckets(/*wait=*/false);
}

at::Tensor ShardedDDP::bucket_buffer(Bucket& b) {
  if (b.buffer.defined()) return b.buffer;
  // Every gradient slot is written (copied or zeroed), and the flags when the bucket is full.
  if (b.rows()) {
    // The other ranks' rows; this rank's own lives in the memory its gradients live in (`out`),
    // where the reduce-scatter sums the others into it.
    b.buffer = take_scratch(b, b.stride * group_->size());
    if (b.zero_fill) b.buffer.zero_();
    if (!b.owned.empty() && !b.out.defined()) b.out = owned_memory(b);
    return b.buffer;
  }
  if (b.owner != group_->rank()) {
    b.buffer = take_scratch(b, b.stride);
    return b.buffer;
  }
  b.buffer = owned_memory(b);
  return b.buffer;
}

// The owner's gradients live in the bucket's memory in its GradSlabs (a row bucket: its row); where
// something still refers to it (gradients not cleared, a view the user keeps), this backward
// reduces in new memory, which ShardedDDP keeps from then on (Note [Gradient slab]).
at::Tensor ShardedDDP::owned_memory(Bucket& b) {
  at::Tensor& kept = b.slabs->bucket_memory(b.index, b.options);
  if (!kept.defined() || kept.storage().use_count() != 1) kept = at::empty({b.stride}, b.options);
  return kept;
}

// A small gradient on the CPU, contiguous and of the bucket's dtype, goes into its slot by
// memcpy (and a missing one, and the alignment gap, by memset): a model of many small tensors
// spends more on the dispatcher than on the bytes. Larger ones, other dtypes and devices take
// copy_. Returns whether it filled the slot.
// `offset`, `numel`, `slot_end`: the entry's slot in the bucket; `from`: its first element in the
// gradient.
static bool fill_small_on_host(int64_t offset, int64_t numel, int64_t slot_end, int64_t from_element,
                               const at::Tensor& buffer, const at::Tensor& grad, int64_t& copied) {
  constexpr int64_t kSmallBytes = 64 << 10;
  const int64_t element = static_cast<int64_t>(buffer.element_size());
  if (!buffer.is_cpu() || (slot_end - offset) * element > kSmallBytes) return false;
  if (grad.defined() && (!grad.is_cpu() || !grad.is_contiguous() || grad.scalar_type() != buffer.scalar_type())) {
    return false;
  }
  char* slot = static_cast<char*>(buffer.data_ptr()) + offset * element;
  const int64_t bytes = numel * element;
  if (grad.defined()) {
    const char* from = static_cast<const char*>(grad.data_ptr()) + from_element * element;
    if (from != slot) {
      std::memcpy(slot, from, static_cast<size_t>(bytes));
      copied += bytes;
    }
  } else {
    std::memset(slot, 0, static_cast<size_t>(bytes));
  }
  std::memset(slot + bytes, 0, static_cast<size_t>((slot_end - offset) * element - bytes));
  return true;
}

void ShardedDDP::fill_param(size_t h) {
  Hooked& hooked = hooked_[h];
  at::Tensor& p = hooked.param;
  at::NoGradGuard no_grad;
  const bool has_grad = p.grad().defined();
  const Entry* owned = nullptr;  // the slot that becomes this rank's gradient of the whole parameter
  bool filled = false;
  for (size_t e : hooked.entries) {
    Entry& entry = entries_[e];
    if (entry.ready) continue;
    filled = true;
    Bucket& b = buckets_[entry.bucket];
    bucket_buffer(b);
    // This rank's own slots of a row bucket are in `out`, every other in the reduce buffer.
    const bool in_out = b.rows() && entry.owned;
    at::Tensor buffer = in_out ? b.out : b.buffer;
    const int64_t shift = in_out ? entry.offset - entry.out_offset : 0;
    const bool owned_whole = has_grad && entry.whole && entry.owned;
    if (fill_small_on_host(entry.offset - shift, entry.numel, entry.slot_end - shift, entry.whole ? 0 : entry.in_param.begin, buffer,
                           has_grad ? p.grad() : at::Tensor(), copying_)) {
      if (owned_whole) owned = &entry;
    } else {
      at::Tensor slot = buffer.narrow(0, entry.offset - shift, entry.numel);
      if (entry.slot_end > entry.offset + entry.numel) {
        buffer.narrow(0, entry.offset - shift + entry.numel, entry.slot_end - entry.offset - entry.numel).zero_();
      }
      if (has_grad) {
        const at::Tensor grad = p.grad();
        if (grad.data_ptr() != slot.data_ptr()) {
          slot.copy_(entry.whole ? grad.reshape(-1) : grad.reshape(-1).narrow(0, entry.in_param.begin, entry.numel));
          copying_ += static_cast<int64_t>(slot.nbytes());
        }
        if (owned_whole) owned = &entry;
      } else {
        slot.zero_();
      }
    }
    entry.ready = true;
    entry.local_grad = has_grad;
    TORCH_INTERNAL_ASSERT(b.pending > 0, "bucket ", entry.bucket, " filled more often than it has entries");
    --b.pending;
  }
  // Filled earlier in this backward (the end of backward passes every parameter): the gradient is
  // already what the first fill left.
  if (!filled) return;
  hooked.slot_alias = nullptr;
  if (has_grad) release_local_grad(hooked, owned);
}

// The local gradient is released as soon as it is in the buckets: the owner of the whole
// parameter keeps a view of its slot `owned` (the reduction overwrites it with the sum), every
// other rank (`owned` null) drops it.
void ShardedDDP::release_local_grad(Hooked& hooked, const Entry* owned) {
  at::Tensor& p = hooked.param;
  if (!owned) {
    p.mutable_grad().reset();
    return;
  }
  // A gradient autograd accumulated where its slot is (Note [Gradients as bucket views]) stays
  // the same tensor, as under DDP; any other becomes a view of its slot.
  const Bucket& b = buckets_[owned->bucket];
  const at::Tensor& buffer = b.owned_slots();
  const int64_t offset = b.rows() ? owned->out_offset : owned->offset;
  const at::Tensor& g = p.grad();
  const bool at_slot = g.is_contiguous() && g.dtype() == buffer.dtype() && g.sizes() == p.sizes() &&
                       g.storage().unsafeGetStorageImpl() == buffer.storage().unsafeGetStorageImpl() &&
                       g.storage_offset() == buffer.storage_offset() + offset;
  if (!at_slot) p.mutable_grad() = alias_at(buffer, offset, p.sizes());
  hooked.slot_alias = p.grad().unsafeGetTensorImpl();
}

// What this rank's owned gradients show about clearing since the last reduction: {a whole one
// left exactly as handed over, a whole one handed over at all (cleared or not), a split piece
// still holding its last reduction}.
at::Tensor ShardedDDP::clearing_evidence() const {
  bool uncleared = uncleared_, seen = false, split_held = false;
  for (const Entry& e : entries_) {
    if (!e.owned || !e.handed_over) continue;
    if (!e.whole) {
      split_held |= is_handed_over(e);
      continue;
    }
    seen = true;
    if (!e.carried.defined() && is_handed_over(e)) {
      uncleared |= static_cast<int64_t>(e.grad()._version()) == e.handed_version;
    }
  }
  return at::tensor({int64_t{uncleared}, int64_t{seen}, int64_t{split_held}}, at::kLong);
}

void ShardedDDP::launch_ready_buckets() {
  CommPhase phase("backward (gradient reductions)");
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    Bucket& b = buckets_[next_launch_++];
    write_flags(b);
    // A sum over one rank is its own buffer: no collective (and, on a GPU, no wait for one).
    if (group_->size() == 1) continue;
    // The mean in the pass that sums, where nothing is summed after it (hierarchical sharding
    // sums across blocks first).
    const double divisor = grad_divisor();
    b.divided = !replica_ && divisor != 1.0;
    // The dtype the bucket travels in, where not its own (Note [Gradient wire]).
    const auto wire = wire_dtype(options_.gradient_wire(), b.options.dtype().toScalarType());
    if (wire && options_.error_feedback()) feed_back_error(b, *wire);
    const int64_t flags = b.stride - b.numel;  // after each row's gradients: exact on an int8 wire
    if (b.rows()) {  // each row's flags are divided too: a flag is only ever compared with zero
      // This rank's row is `out` (where its gradients were copied or accumulated): the others
      // are summed into it.
      // Rows of whole parameters move only what their pieces occupy (Note [Rows with padding]).
      b.work = b.out.defined() ? reducer().reduce_scatter_rows_into_async(b.buffer, b.out, b.divided ? divisor : 1.0,
                                                                        wire, flags, b.row_used)
                               : reducer().reduce_scatter_rows_async(b.buffer, b.divided ? divisor : 1.0, {}, wire,
                                                                   flags, b.row_used);
    } else if (wire) {
      b.work = reducer().reduce_mean_async(b.buffer, b.owner, b.divided ? b.numel : 0, b.divided ? divisor : 1.0, wire,
                                         flags);
    } else {
      b.work = b.divided ? reducer().reduce_mean_async(b.buffer, b.owner, b.numel, divisor)
                         : reducer().reduce_async(b.buffer, b.owner);
    }
    if (timeline::recording()) {
      b.work.on_timeline(timeline::Lane::kReduction, "bucket " + std::to_string(next_launch_ - 1) +
                                                         (b.rows() ? " reduce-scatter" : " reduce to rank " + std::to_string(b.owner)));
    }
  }
}

// Note [Error feedback]
// ShardedDDPOptions::error_feedback keeps, per bucket, what rounding to the wire dropped from this
// rank's contribution, and adds it to the next contribution before rounding again, as 1-bit
// Adam's and PowerSGD's error feedback do: the gradient each rank sends over k reductions sums to
// its true gradients' sum minus one residual, so the rounding errors cancel over steps instead of
// biasing every one of them. The contribution is rounded here, and the residual taken, before the
// collective starts; the wire then moves the rounded values unchanged, and the owner sums and
// divides as without it (Note [Gradient wire]): the division by the world size follows the sum,
// after rounding. The residual is kept in bf16 (2 bytes per element this rank sends, that is per
// trainable element of the buckets, the whole model's on every rank, not 1/W of it;
// error_feedback_bytes()); a residual held in bf16 is itself rounded, by at most 2^-9 of its own
// size. On the int8 wire (Note [Int8 wire]) the rounded contribution is quantised again by the
// wire: the same int8 values, and a scale that may differ in its last bit, so what arrives may
// differ from what the residual assumed by that last bit. On the CPU the step is one pass over
// memory (WireCodec::feed_back), with the bits of the separate operations. Only the gradient
// elements carry residuals, not the flags (0 or 1: exact on the wire). A new layout (a freeze, a re-partition) builds the
// buckets anew and starts their residuals at zero: the residuals of parameters that were frozen
// are dropped, and an unfrozen parameter starts from zero. Sharded checkpoints carry them (Note
// [Error feedback in checkpoints] in error_feedback_state.cpp). A backward under no_sync feeds back nothing (its gradients are
// reduced by the next reduction, which feeds back then).
void ShardedDDP::feed_back_error(Bucket& b, at::ScalarType wire) {
  at::NoGradGuard no_grad;
  const int64_t rows = b.rows() ? group_->size() : 1;
  const detail::WireCodec codec(wire);
  if (!b.residual.defined() && restored_residuals_) adopt_restored_residuals();
  if (!b.residual.defined()) b.residual = at::zeros({rows * b.numel}, b.options.dtype(at::kBFloat16));
  for (int64_t r = 0; r < rows; ++r) {
    // This rank's own row of a row bucket is in `out` when it has one (Note [Row buckets]).
    at::Tensor mine = b.rows() && r == group_->rank() && b.out.defined() ? b.out.narrow(0, 0, b.numel)
                                                                        : b.buffer.narrow(0, r * b.stride, b.numel);
    // It then travels unchanged (int8: up to a last bit of its scale).
    codec.feed_back(mine, b.residual.narrow(0, r * b.numel, b.numel));
  }
}

// The flags (1 where this rank had a gradient), in one operation when every entry had one.
void ShardedDDP::write_flags(Bucket& b) {
  const int64_t n = static_cast<int64_t>(b.entries.size());
  int64_t with = 0;
  for (size_t e : b.entries) with += entries_[e].local_grad ? 1 : 0;
  if (!b.rows()) {
    at::Tensor flags = b.buffer.narrow(0, b.numel, n);
    if (with == n) {
      flags.fill_(1);
      return;
    }
    flags.zero_();
    for (int64_t k = 0; k < n && with > 0; ++k) {
      if (entries_[b.entries[k]].local_grad) flags.narrow(0, k, 1).fill_(1);
    }
    return;
  }
  // A row bucket: every row's flag slots at once, from a table made on the host.
  const int64_t world = group_->size(), per_row = b.stride - b.numel;
  at::Tensor rows = b.buffer.view({world, b.stride}).narrow(1, b.numel, per_row);
  at::Tensor own = b.out.defined() ? b.out.narrow(0, b.numel, per_row) : at::Tensor();
  if (with == n && !b.zero_fill) {
    rows.fill_(1);  // (slots past a row's last entry are never read)
    if (own.defined()) own.fill_(1);
    return;
  }
  at::Tensor table = at::zeros({world, per_row}, at::TensorOptions().dtype(b.options.dtype()));
  for (size_t e : b.entries) {
    const Entry& entry = entries_[e];
    if (!entry.local_grad) continue;
    const int64_t flag = entry.flag;
    table.select(0, flag / b.stride).narrow(0, flag % b.stride - b.numel, 1).fill_(1);
  }
  rows.copy_(table);
  if (own.defined()) own.copy_(table.select(0, group_->rank()));
}

double ShardedDDP::grad_divisor() const {
  if (options_.grad_scaling() == GradScaling::kMean) return global_->size();
  if (options_.grad_scaling() == GradScaling::kGlobalSamples && global_samples_ > 0) {
    return static_cast<double>(global_samples_);
  }
  return 1.0;
}

void ShardedDDP::finish_reduction() {
  CommPhase phase("backward (gradient reductions)");
  phase_ = Phase::kIdle;
  // Parameters that got no gradient in this backward still take part, so every rank launches
  // the same buckets; their flags say whether any rank had a gradient (from this backward or
  // accumulated under no_sync).
  for (size_t h = 0; h < hooked_.size(); ++h) fill_param(h);
  launch_ready_buckets();
  if (options_.step_in_backward()) {
    end_backward_steps();
    return;
  }
  for (auto& b : buckets_) {
    b.work.wait();
    if (!b.rows() && !b.owned.empty()) b.out = b.buffer;
    give_back_scratch(b);
  }
  // Whether gradients were left uncleared, for the split pieces (Note [Accumulating across
  // reductions]): one small all-reduce, with split parameters only.
  bool ambiguous = false;
  carry_split_ = false;
  if (has_split_pieces_) {
    at::Tensor seen = clearing_evidence();
    if (global_->size() > 1) global_->allreduce(seen, Reduction::kMax);
    const int64_t* v = seen.data_ptr<int64_t>();
    carry_split_ = v[0] > 0;
    ambiguous = v[1] == 0 && v[2] > 0;
  }
  uncleared_ = false;

  const std::string error = reduction_error(ambiguous);
  if (error.empty()) hand_over_reduced();
  reset_executor();  // ready for the next backward whatever happened
  SHARDOPT_CHECK(error.empty(), error);
}

// Why the reduction just finished must not be handed over, or "": a parameter that became
// trainable without a rebuild (its gradient is local, unreduced), clearing that cannot be told
// (Note [Accumulating across reductions]), or kGlobalSamples without its count.
std::string ShardedDDP::reduction_error(bool ambiguous) const {
  for (size_t k = 0; k < params_.size(); ++k) {
    if (!built_trainable(k) && params_[k].grad().defined() && params_[k].requires_grad()) {
      return "parameter '" + names_[k] + "' became trainable after the last rebuild; call refresh_trainable() "
             "(or keep auto_refresh_trainable on and call forward())";
    }
  }
  if (ambiguous) {
    return "cannot tell whether the gradients of the last backward were cleared: every trainable parameter "
           "is split across ranks (OSS PartitionMode kSplit) and split gradients are out of reach of "
           "module->zero_grad() and p.grad(). Clear with the OSS's or ShardedDDP's zero_grad(), accumulate "
           "under no_sync(), or use OSSOptions().partition(PartitionMode::kWholeParameters)";
  }
  if (options_.grad_scaling() == GradScaling::kGlobalSamples && global_samples_ <= 0) {
    return "grad_scaling kGlobalSamples needs set_global_samples(n > 0) before each backward (got " +
           std::to_string(global_samples_) + ")";
  }
  return "";
}

void ShardedDDP::reset_executor() {
  for (auto& b : buckets_) {
    b.buffer = at::Tensor();
    b.scratch = at::Tensor();  // (a reduction that failed: its scratch is not kept)
    b.out = at::Tensor();
    b.in_place = false;
    b.divided = false;
    b.pending = b.entries.size();
  }
  phase_ = Phase::kIdle;
  copied_bytes_ = copying_;
  copying_ = 0;
  for (auto& hooked : hooked_) hooked.slot_alias = nullptr;
  for (auto& entry : entries_) {
    entry.ready = false;
    entry.local_grad = false;
    entry.carried = at::Tensor();
  }
  next_launch_ = 0;
  next_step_ = 0;
  stepping_ = false;
  scratch_held_ = 0;
  next_recycle_ = 0;
  global_samples_ = -1;
}

void ShardedDDP::hand_over_reduced() {
  const double divisor = grad_divisor();
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> flag_parts;
  // A flag counts the ranks that had a gradient, so one this rank had a gradient for is nonzero
  // whatever the others did. When that holds for every owned entry (every trainable parameter got
  // a gradient: the usual step), the flags are not read: no host synchronisation on a GPU.
  bool all_local = true;
  for (auto& b : buckets_) {
    for (size_t e : b.owned) all_local = all_local && entries_[e].local_grad;
  }
  for (auto& b : buckets_) {
    if (b.owned.empty()) continue;
    // Hierarchical sharding: the block's sum, summed over the blocks (flags included).
    if (replica_) {
      CommPhase phase("backward (gradient all-reduce across blocks)");
      replica_->allreduce(b.out);
    }
    at::Tensor grads = b.out.narrow(0, 0, b.numel);
    if (divisor != 1.0 && !b.divided) grads.div_(divisor);
    if (!all_local) {
      flag_parts.push_back(b.out.narrow(0, b.numel, static_cast<int64_t>(b.owned.size())).to(at::kDouble));
    }
  }
  // Otherwise every owned bucket's flags, read off the device in one copy (one host
  // synchronisation on a GPU, not one per bucket).
  const at::Tensor all_flags = all_local ? at::Tensor() : at::cat(flag_parts).to(at::kCPU);
  const double* flag = all_local ? nullptr : all_flags.data_ptr<double>();
  int64_t next_flag = 0;
  for (auto& b : buckets_) {
    for (size_t k = 0; k < b.owned.size(); ++k, ++next_flag) {
      give_reduced(entries_[b.owned[k]], b, all_local || flag[next_flag] != 0);
    }
  }
}

void ShardedDDP::give_reduced(Entry& entry, const Bucket& b, bool any) {
  if (!any) {
    // No rank had a gradient: a whole parameter keeps what it holds, as under DDP.
    if (!entry.whole) entry.set_grad(at::Tensor());
    return;
  }
  // The owner's gradient lives in the reduced bucket: no second copy. What the last
  // reduction handed over, if still there, gets it added (Note [Accumulating across
  // reductions]); after a step in the backward it was stepped already, and is replaced.
  // A gradient that already is this slot (the alias fill_param() kept) holds the reduction;
  // nothing more is carried into it than was set aside before accumulation.
  const bool at_slot = entry.whole && entry.grad().defined() &&
                       entry.grad().unsafeGetTensorImpl() == hooked_[entry.hooked].slot_alias;
  if (!at_slot && !entry.carried.defined() && (entry.whole || carry_split_) && !options_.step_in_backward() &&
      is_handed_over(entry)) {
    entry.carried = entry.grad();
  }
  if (entry.carried.defined()) {
    entry.set_grad(entry.carried.add_(alias_at(b.out, entry.out_offset, entry.sizes())));
  } else if (!at_slot) {
    entry.set_grad(alias_at(b.out, entry.out_offset, entry.sizes()));
  }
  entry.handed_over.emplace(entry.grad().getIntrusivePtr());
  entry.handed_version = static_cast<int64_t>(entry.grad()._version());
}

void ShardedDDP::reduce() {
  SHARDOPT_CHECK(phase_ != Phase::kReducing, "reduce() called during backward");
  SHARDOPT_CHECK(!no_sync_, "reduce() called inside no_sync()");
  await_mask_check();
  finish_reduction();
}

void ShardedDDP::set_global_samples(int64_t real_samples) {
  SHARDOPT_CHECK(real_samples > 0, "set_global_samples needs a positive count, got ", real_samples);
  global_samples_ = real_samples;
}

}  // namespace shardopt
