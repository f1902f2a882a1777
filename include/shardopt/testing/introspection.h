// What the tests and benchmarks read of OSS's and ShardedDDP's insides. Training code has no use
// for any of it, and none of it is part of the API (docs/api.md).
#pragma once

#include <shardopt/comm/wire.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/oss.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace shardopt::testing {

struct Introspection {
  // ---- OSS's partition and holdings ----
  // All parameters, in global order (groups concatenated), and where one of them is.
  static const std::vector<at::Tensor>& all_params(const OSS& oss) { return oss.all_params(); }
  static size_t index_of(const OSS& oss, const at::Tensor& param) { return oss.index_of(param); }
  // Who owns each parameter when parameters stay whole (Note [Split parameters]).
  static const Partition& partition(const OSS& oss);
  // Whether parameters are split across owners (PartitionMode resolved).
  static bool split(const OSS& oss) { return oss.placement_.split; }
  // Whether parameter `param` stays whole on one owner.
  static bool kept_whole(const OSS& oss, size_t param) { return oss.kept_whole(param); }
  // The trainable elements the busiest rank owns against 1/world_size: max / ideal - 1.
  static double imbalance(const OSS& oss) { return oss.layout().imbalance(); }
  // Counts re-partitions: owner() answers differently after it changed.
  static int64_t partition_version(const OSS& oss) { return oss.partition_version_; }
  // Counts moves of state between ranks (a re-partition, or split ranges cut again).
  static int64_t state_moves(const OSS& oss) { return oss.state_moves_; }
  // With shard_group_size, the group of this rank's replicas; null without blocks.
  static ProcessGroup* replica_group(const OSS& oss) { return oss.replica_group(); }
  // The wrapped optimizer over this rank's holdings: the first, or the k-th of several
  // (OptimizerGroup).
  static torch::optim::Optimizer& local_optimizer(OSS& oss, size_t k = 0) { return *oss.units_.at(k).local; }
  static size_t num_optimizers(const OSS& oss) { return oss.units_.size(); }
  // Makes every rank's copy of the parameters equal to the owner's. Collective.
  static void sync_params(OSS& oss);
  // The overlapped sync of one parameter (an index in all_params()).
  static void finish_param_sync(OSS& oss, size_t param) { oss.finish_param_sync(param); }

  // Whether the overlapped parameter sync of the last step() is still in flight.
  static bool param_sync_in_flight(const OSS& oss);
  // Counts OSS's layouts (a trainable set, owners or bucket cuts changed): the version of its
  // shard plan (Note [Shard plan] in csrc/optim/shard_plan.h).
  static int64_t layout_version(const OSS& oss);
  // Whether the last step() used the fused step.
  static bool stepped_fused(const OSS& oss) { return oss.stepped_fused_; }
  // The segments of adjacent tensors the last fused step stepped (Note [Adjacent tensors in one
  // pass] in csrc/optim/adjacent.h); on CUDA, 32 of a run share one launch.
  static int64_t fused_segments(const OSS& oss) { return oss.fused_segments_; }
  // The last step by bucket (Note [A step per bucket] in csrc/optim/oss_step.cpp), in order:
  // ('s', k) row bucket k's holdings stepped, ('g', k) its all-gather started.
  static const std::vector<std::pair<char, int64_t>>& bucket_steps(const OSS& oss) { return oss.bucket_steps_; }
  // Bytes of gradients the last reduction copied into buckets: gradients autograd accumulated
  // where their bucket is (gradient_as_bucket_view) are not copied.
  static int64_t copied_grad_bytes(const ShardedDDP& ddp) { return ddp.copied_bytes_; }
  // Error feedback's step for one row on `wire` (kBFloat16 or kInt8), in place, as ShardedDDP
  // takes it before sending (Note [Error feedback]): x += residual, x = x as the wire delivers it,
  // residual = what that dropped, in bf16.
  static void feed_back(Wire wire, at::Tensor x, at::Tensor residual);
  // The most buckets that held reduce scratch at once (Note [Reduce scratch]), over its life.
  static size_t most_scratch_held(const ShardedDDP& ddp) { return ddp.most_scratch_held_; }

  // One range of a parameter whose optimizer state one rank holds, and, on that rank, the tensor
  // the wrapped optimizer steps for it (its state key).
  struct Holding {
    int rank = -1;
    Range in_param;
    at::Tensor tensor;
  };
  static std::vector<Holding> holdings(const OSS& oss, size_t param);
  // Which rank holds the optimizer state of each element of parameter `param` (kInt, one per
  // element; -1 where no rank does), from holdings().
  static at::Tensor state_holders(const OSS& oss, size_t param);
  // state_holders of every parameter, in OSS's order.
  static std::vector<at::Tensor> state_holders(const OSS& oss);
  // How many elements some rank holds the state of both in `before` and in `after` (two lists
  // from state_holders), but not the same rank: the elements whose state moves between the two.
  static int64_t holders_changed(const std::vector<at::Tensor>& before, const std::vector<at::Tensor>& after);

  // Where the state of `stepped` (a tensor of local_optimizer()) lives in the store's slabs
  // (Note [State slabs] in csrc/optim/state_slabs.cpp); nullopt when it has no slot.
  struct StateSlot {
    size_t group = 0;
    int64_t offset = 0;
    int64_t numel = 0;
    bool kept = false;
  };
  static std::optional<StateSlot> state_slot(const OSS& oss, const at::Tensor& stepped);
  // The slab of state `kind` ("exp_avg", ...) of layout group `group`; undefined when none.
  static at::Tensor state_slab(const OSS& oss, size_t group, const std::string& kind);
  // Bytes of all the store's slabs on this rank.
  static int64_t slab_bytes(const OSS& oss);
  // The gradient slab of layout group `group` of optimizer `optimizer` (Note [Gradient slab] in
  // csrc/ddp/grad_slabs.cpp): the memory of the buckets this rank owns; undefined before a
  // backward asked for them.
  static at::Tensor grad_slab(const ShardedDDP& ddp, size_t optimizer, size_t group);

  // The CPU build of the fused step's loops that runs: 2 AVX-512, 1 AVX2 + FMA, 0 portable. Cap
  // it at `level` to compare the builds (-1: as SHARDOPT_FUSED_KERNELS says).
  static int cpu_kernel_level();
  static void cap_cpu_kernels(int level);

  // ---- a group's waits ----
  // Waits for `work` under a failure watch of its own, as every wait of a group that goes on
  // after a death is waited for (Note [Failure watch] in csrc/comm/failure_watch.cpp): a Gloo
  // collective's wait runs in slices. Returns whether the wait marked the watch broken; what the
  // wait threw, if anything, goes to `error`.
  static bool wait_watched(PendingWork& work, std::string& error);
  // Makes a Gloo group reduce on the int8 wire as an NCCL group does, through one all-to-all (rows)
  // or one gather (to one owner) per bucket instead of direct transfers (Note [Int8 wire on
  // collectives] in csrc/comm/on_wire.cpp): how that path runs where NCCL has one GPU.
  static void wire_by_collectives(ProcessGroup& group) { group.wire_by_collectives_ = true; }
};

}  // namespace shardopt::testing
