// What one rank of a run will hold and send, computed from the model's shapes alone with the
// library's own placement and FlatLayout code (shardopt/optim/placement.h): the decisions OSS
// and ShardedDDP make at construction and after a freeze, without a tensor or a process group.
//
// Memory, per rank: the flat parameter buffers (padding included), the gradients it holds after
// a step, the gradient memory kept between steps beyond them (ZeRO-2: its owned bucket slabs'
// counts and alignment; DDP and ZeRO-1: one all-reduce bucket over all trainable gradients, kept
// at its largest, as DDP's are), fp32 masters under mixed precision, and the optimizer state. The
// same quantities `shardopt memory` counts on real ranks.
//
// Traffic, per rank and step (Note [Plan traffic] in shard_plan.cpp): the bytes each collective
// moves under the ring and chain algorithms NCCL uses, within the shard group ("block") and
// across blocks (the replica all-reduce, or an all-reduce over the whole group when it spans
// blocks).
#pragma once

#include "model_spec.h"

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt::app {

struct PlanConfig {
  std::string mode = "zero2";     // ddp, zero1, zero2, zero1-bf16, zero2-bf16
  int world_size = 1;
  int shard_group_size = 0;       // 0: the whole group
  std::string optimizer = "adam"; // or "muon" (Muon on the matrices: muon_matrix)
  std::string partition = "auto"; // auto, split, whole (PartitionMode)
  int64_t bucket_bytes = 8 << 20; // ZeRO-2's reduce buckets (ShardedDDPOptions::reduce_bucket_bytes)
  double freeze_fraction = 0.0;   // leading layers frozen for the second scenario (0: none)
  std::string gradient_wire = "exact";  // ZeRO-2's gradients on the wire: exact or bf16 (ShardedDDPOptions::gradient_wire)
  std::string param_wire = "exact";     // the parameter sync on the wire: exact or bf16 (OSSOptions::param_wire)
  bool error_feedback = false;          // ZeRO-2 on a compressed gradient wire: residuals (ShardedDDPOptions::error_feedback)
  std::string state_format = "fp32";    // ZeRO-1/2's optimizer state: fp32, bf16 or int8 (OSSOptions::state_format)
};

// One rank's bytes and traffic.
struct RankPlan {
  int rank = 0;  // within its block (every block is alike)
  double params = 0, grads = 0, buckets = 0, masters = 0, state = 0;
  // Error feedback's residuals: bf16, one per element of the buckets it sends into (every
  // trainable element, on every rank: outside the 1/N of the gradients).
  double feedback = 0;
  double sent_block = 0, received_block = 0, sent_across = 0, received_across = 0;
  // Collectives per step it takes part in (Note [Plan latency] in plan.cpp): chains (a reduce to
  // an owner, a broadcast from one, or a ring reduce-scatter or all-gather of a row bucket: k - 1
  // steps each) and all-reduces over its block, all-reduces across blocks
  // (the replica group, or the whole group when it spans blocks).
  int64_t chains_block = 0, allreduces_block = 0, allreduces_across = 0;
  int64_t collectives() const { return chains_block + allreduces_block + allreduces_across; }
  double total() const { return params + grads + buckets + masters + state + feedback; }
  double sent() const { return sent_block + sent_across; }
  double received() const { return received_block + received_across; }
};

// One scenario (all trainable, or part frozen) of one configuration.
struct ScenarioPlan {
  std::string scenario;            // "all trainable", "50% frozen"
  int64_t trainable = 0;           // elements
  bool split = false;              // parameters cut into equal ranges
  size_t buckets = 0;              // the layout's buckets (the collectives of a step per block)
  double layout_imbalance = 0.0;   // FlatLayout::imbalance(): trainable elements of the busiest rank
  std::vector<RankPlan> ranks;     // one block's ranks (the whole group without blocks)
};

// Both scenarios of `config` (the second when freeze_fraction > 0). Errors name the option.
std::vector<ScenarioPlan> plan_config(const ModelSpec& spec, const PlanConfig& config);

// The leading layers whose elements fit in `fraction` of the model: frozen in the second
// scenario, by `shardopt plan` and `shardopt memory` alike. Returns the trainable flags.
std::vector<uint8_t> freeze_leading(const ModelSpec& spec, double fraction, int64_t* frozen_numel);

}  // namespace shardopt::app
