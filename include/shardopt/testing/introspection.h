// What the tests and benchmarks read of OSS's and ShardedDDP's insides. Training code has no use
// for any of it, and none of it is part of the API (docs/api.md).
#pragma once

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
  // Whether the overlapped parameter sync of the last step() is still in flight.
  static bool param_sync_in_flight(const OSS& oss);
  // Counts OSS's layouts (a trainable set, owners or bucket cuts changed).
  static int64_t layout_version(const OSS& oss);
  // Whether the last step() used the fused step.
  static bool stepped_fused(const OSS& oss) { return oss.stepped_fused_; }
  // The segments of adjacent tensors the last fused step stepped (Note [Adjacent tensors in one
  // pass] in csrc/optim/adjacent.h); on CUDA, 32 of a run share one launch.
  static int64_t fused_segments(const OSS& oss) { return oss.fused_segments_; }
  // Bytes of gradients the last reduction copied into buckets: gradients autograd accumulated
  // where their bucket is (gradient_as_bucket_view) are not copied.
  static int64_t copied_grad_bytes(const ShardedDDP& ddp) { return ddp.copied_bytes_; }

  // One range of a parameter whose optimizer state one rank holds, and, on that rank, the tensor
  // the wrapped optimizer steps for it (its state key).
  struct Holding {
    int rank = -1;
    Range in_param;
    at::Tensor tensor;
  };
  static std::vector<Holding> holdings(const OSS& oss, size_t param);

  // Where the state of `stepped` (a tensor of local_optimizer()) lives in the store's slabs
  // (Note [Shard store] in csrc/optim/shard_store.cpp); nullopt when it has no slot.
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
  // The gradient slab of layout group `group` (Note [Gradient slab] in csrc/optim/shard_grads.cpp):
  // the memory of the buckets this rank owns; undefined before a backward asked for them.
  static at::Tensor grad_slab(const OSS& oss, size_t group);

  // The CPU build of the fused step's loops that runs: 2 AVX-512, 1 AVX2 + FMA, 0 portable. Cap
  // it at `level` to compare the builds (-1: as SHARDOPT_FUSED_KERNELS says).
  static int cpu_kernel_level();
  static void cap_cpu_kernels(int level);
};

}  // namespace shardopt::testing
