// OSS's step in a ShardedDDP's backward: begun at the backward's first gradient, a bucket's
// holdings stepped as soon as its reduction is handed over, each bucket's parameter sync started
// as soon as what it sends is stepped, and step() finishing what the backward began.
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>

#include "optim/backward_step.h"
#include "optim/fused_step_mixed.h"
#include "optim/shard_store.h"
#include "optim/state_slabs.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>

namespace shardopt {

// Note [A step in the backward]
// Under ShardedDDPOptions::step_in_backward, the step of Note [A step per bucket] moves into the
// backward. ShardedDDP begins it at the backward's first gradient (begin_backward_step: the state
// settled for the plan, the options taken, the sync opened) and hands each bucket over as soon as
// its reduction has completed; OSS then steps the holdings in that bucket (a layout cuts its
// buckets at parameter boundaries, so a bucket's reduction completes every gradient its holdings
// need) and starts that bucket's sync at once. So the first buckets' all-gathers travel while
// autograd computes the rest of the backward and the later buckets reduce, where otherwise they
// wait for the whole backward and the whole step. The buckets are stepped and sent in index
// order, the order they reduce in (the last layers first); a bucket handed over early waits for
// the ones before it. Every rank so starts the same syncs in the same order, whenever its own
// reductions complete; the reductions run on a group of their own (ShardedDDP's reducer()), so
// the two orders never mix. When the backward's last bucket is in, the holdings in no bucket step
// (end_backward_step); step() then finishes the sync (or, under overlap_param_sync, leaves it to
// the next forward) and returns. Each element is stepped by the same fused step, from the same
// state and the same reduced gradient, as by the step after the backward, so the parameters and
// the state are bit for bit the same. The options a step takes (a learning-rate scheduler's) are
// those set when the backward begins. What needs every gradient first (clip_grad_norm, a gradient
// scaler's found-inf) is refused (steps_in_backward()).
bool OSS::steps_in_backward() const {
  return store_->handed_over() && store_->step_in_backward();
}

void OSS::begin_backward_step() {
  SHARDOPT_CHECK(!backward_step_, "ShardedDDPOptions::step_in_backward: a backward on rank ", group_->rank(),
                 " began before step() finished the step the last backward began; call step() after each backward "
                 "outside no_sync() (accumulate gradients under no_sync())");
  at::NoGradGuard no_grad;
  finish_param_sync();
  settle_state();  // the set was agreed at the forward: every rank moves the same ranges
  sync_options_to_local();
  auto step = std::make_unique<detail::BackwardStep>();
  step->from_masters = masters_ ? store_->master_rows(holdings_, group_->rank(), slabs_->slabs_of(detail::kMasterSlab))
                                : detail::MasterRows{};
  store_->begin_step_sync();
  const FlatLayout& layout = store_->layout();
  const auto& buckets = layout.buckets();
  const size_t n = buckets.size();
  const int rank = group_->rank();
  step->by_bucket.resize(n + 1);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!steps(i)) continue;
    // A layout cuts its buckets at parameter boundaries (Note [Row buckets] in flat_layout.h): all
    // of a parameter's pieces lie in one bucket.
    int64_t bucket = -1;
    for (size_t k : layout.pieces_of(i)) {
      const int64_t b = layout.pieces()[k].bucket;
      TORCH_INTERNAL_ASSERT(bucket < 0 || b < 0 || b == bucket, "parameter ", i, " lies in buckets ", bucket, " and ", b);
      bucket = std::max(bucket, b);
    }
    for (const auto& h : holdings_[i]) {
      if (h.rank == rank) step->by_bucket[bucket < 0 ? n : static_cast<size_t>(bucket)].emplace_back(i, &h);
    }
  }
  const bool broadcast = options_.sync() == ParamSync::kBroadcast;
  step->syncs.resize(n);
  for (size_t k = 0; k < n; ++k) step->syncs[k] = broadcast || buckets[k].rows();
  step->reduced.assign(n, 0);
  bucket_steps_.clear();
  fused_segments_ = 0;
  stepped_fused_ = true;
  backward_step_ = std::move(step);
}

void OSS::step_holdings(const std::vector<std::pair<size_t, const detail::Holding*>>& these) {
  if (these.empty()) return;
  detail::FusedStepInputs in;
  in.allocate = [this](const at::Tensor& t, const char* kind) { return slabs_->fresh_slot(t, kind); };
  if (options_.state_format() == StateFormat::kInt8) {
    in.scales = [this](const at::Tensor& codes) { return slabs_->scales_of(codes); };
  }
  std::vector<std::pair<size_t, const detail::Holding*>> stepped;
  for (const auto& [i, h] : these) {
    if (add_step_input(in, i, *h, mixed_kernel_for(unit_of_group_[group_of_[i]]))) stepped.emplace_back(i, h);
  }
  for (const auto& unit : units_) {
    const std::string why = detail::fused_step_unsupported(*unit.local, in);
    SHARDOPT_CHECK(why.empty(), "ShardedDDPOptions::step_in_backward on rank ", group_->rank(), ": the fused step cannot step ",
                   unit.class_name, " now: ", why);
  }
  for (const auto& unit : units_) fused_segments_ += detail::fused_step(*unit.local, in).segments;
  if (masters_) {
    for (const auto& [i, h] : stepped) write_back_master(i, *h, in, backward_step_->from_masters);
  }
}

void OSS::start_ready_syncs() {
  detail::BackwardStep& step = *backward_step_;
  for (; static_cast<int64_t>(step.next_sync) <= step.reduced_through; ++step.next_sync) {
    if (!step.syncs[step.next_sync]) continue;  // goes with the sync after the step
    store_->start_bucket_sync(step.next_sync, step.from_masters.rows);
    if (store_->param_sync_in_flight()) bucket_steps_.emplace_back('g', static_cast<int64_t>(step.next_sync));
  }
}

void OSS::step_reduced_bucket(size_t bucket) {
  TORCH_INTERNAL_ASSERT(backward_step_, "a bucket handed over outside a step in the backward");
  detail::BackwardStep& step = *backward_step_;
  at::NoGradGuard no_grad;
  step.reduced.at(bucket) = 1;
  while (step.reduced_through + 1 < static_cast<int64_t>(step.reduced.size()) &&
         step.reduced[static_cast<size_t>(step.reduced_through + 1)]) {
    const auto k = static_cast<size_t>(++step.reduced_through);
    const int64_t began = timeline::now_us();
    step_holdings(step.by_bucket[k]);
    timeline::record(timeline::Lane::kStep, "bucket " + std::to_string(k) + " step", group_->rank(), began, timeline::now_us());
    bucket_steps_.emplace_back('s', static_cast<int64_t>(k));
  }
  start_ready_syncs();
}

void OSS::end_backward_step() {
  TORCH_INTERNAL_ASSERT(backward_step_, "no step in the backward to end");
  detail::BackwardStep& step = *backward_step_;
  at::NoGradGuard no_grad;
  // Buckets with nothing to reduce in this backward (none of this layout's buckets launched: an
  // optimizer whose parameters got no bucket) count as reduced.
  for (size_t k = 0; k < step.reduced.size(); ++k) {
    if (!step.reduced[k]) step_reduced_bucket(k);
  }
  step_holdings(step.by_bucket.back());
  start_ready_syncs();
  step.ended = true;
}

bool OSS::finish_backward_step() {
  SHARDOPT_CHECK(backward_step_->ended, "step() on rank ", group_->rank(), " while the step its ShardedDDP's backward "
                 "began is not done: the backward raised an error before its last bucket; the optimizer state is "
                 "partly stepped (start again from a checkpoint)");
  const auto step = std::move(backward_step_);
  auto& has_state = store_->stepped();
  for (size_t i = 0; i < params_.size(); ++i) has_state[i] |= steps(i);
  store_->sync_after_step(step->from_masters.rows);
  place_state();  // (as the step after the backward)
  return true;
}

}  // namespace shardopt
