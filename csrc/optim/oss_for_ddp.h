// What ShardedDDP (csrc/ddp) needs of an OSS beyond its public face, in one header: the store it
// takes over (the layout, the parameter buffers, the owned gradients: shard_store.h), the
// trainable set's helpers (trainable.h), and the calls on OSS's private side that only a
// ShardedDDP makes (OssForDdp). csrc/ddp includes this header and no other of csrc/optim. Internal.
#pragma once

#include <shardopt/optim/oss.h>

#include "optim/shard_store.h"
#include "optim/trainable.h"

#include <cstdint>
#include <vector>

namespace shardopt::detail {

struct OssForDdp {
  // The store, handed over once, in ShardedDDP's constructor (Note [Owned gradients]).
  static ShardStore& hand_over(OSS& oss, const HandOver& h) { return oss.hand_over(h); }
  // OSS's parameters, in its order (the order of the trainable masks below).
  static const std::vector<at::Tensor>& params(const OSS& oss) { return oss.all_params(); }
  // With shard_group_size, the group of this rank's replicas; null without blocks.
  static ProcessGroup* replica_group(const OSS& oss) { return oss.replica_group(); }
  // Whether parameter `param` stays whole on one owner.
  static bool kept_whole(const OSS& oss, size_t param) { return oss.kept_whole(param); }
  // Lays the store out for `trainable` (agreed on every rank); returns whether it did.
  static bool lay_out_for(OSS& oss, const std::vector<uint8_t>& trainable) { return oss.lay_out_for(trainable); }
  // Re-partitions when the trainable work is lopsided; collective.
  static bool rebalance(OSS& oss) { return oss.rebalance(); }
  // The overlapped parameter sync of parameter `param`; local.
  static void finish_param_sync(OSS& oss, size_t param) { oss.finish_param_sync(param); }
  // The optimizers' options, for ShardedDDP's agreement at its forward.
  static uint64_t options_hash(const OSS& oss) { return oss.options_hash(); }
  static void check_options_alike(const OSS& oss) { oss.check_options_alike(); }
  // The step in the backward (Note [A step in the backward] in oss_step_in_backward.cpp).
  static void begin_backward_step(OSS& oss) { oss.begin_backward_step(); }
  static void step_reduced_bucket(OSS& oss, size_t bucket) { oss.step_reduced_bucket(bucket); }
  static void end_backward_step(OSS& oss) { oss.end_backward_step(); }
};

}  // namespace shardopt::detail
