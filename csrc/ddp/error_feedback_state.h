// ErrorFeedbackState: what a checkpoint needs of ShardedDDP's error feedback. The residuals this
// rank keeps, with the layout they follow, as one value for its file, and restoring them (Note
// [Error feedback in checkpoints] in error_feedback_state.cpp). save_checkpoint and
// load_checkpoint's ShardedDDP forms are its only users; ShardedDDP keeps the residuals private.
#pragma once

#include <shardopt/ddp/sharded_ddp.h>

#include <ATen/core/ivalue.h>

namespace shardopt::detail {

struct ErrorFeedbackState {
  // Whether `ddp` keeps residuals (ShardedDDPOptions::error_feedback).
  static bool kept(const ShardedDDP& ddp) { return ddp.options_.error_feedback(); }
  // Whether `optimizer` is one of those `ddp` reduces gradients for.
  static bool reduces_for(const ShardedDDP& ddp, const OSS& optimizer);
  // This rank's residuals and their layout: a dict of "layout" (an int64 tensor) and "residuals"
  // (one tensor per bucket, empty where the bucket has none yet). Local.
  static c10::IValue save(const ShardedDDP& ddp);
  // Drops the residuals `ddp` keeps now and takes `saved` (a save() value), or none (None): the
  // next reduction starts from them where its buckets have their layout, from zero otherwise.
  // Local.
  static void restore(ShardedDDP& ddp, const c10::IValue& saved);
};

}  // namespace shardopt::detail
