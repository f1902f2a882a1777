// ShardPlan: where everything of one OSS lives, as one immutable value (Note [Shard plan]).
// Internal to shardopt: the store (shard_store.h) holds the current plan.
#pragma once

#include <shardopt/optim/flat_layout.h>
#include <shardopt/optim/partition.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace shardopt::detail {

// Note [Shard plan]
// One value says where everything of an OSS lives: the trainable set it was made for, the owners
// of whole parameters (the partition), and the layout, with its buckets, its rows and the owner of
// every piece. A plan is made at one point every rank reaches with the same trainable set (OSS's
// step after its trainability check, or ShardedDDP's forward, whose overlapped check confirms the
// set before any gradient is reduced: Note [Overlapped trainability check]), by
// ShardStore::make_plan, a pure function of that set, the partition and what has state to keep,
// so every rank makes the same plan. A plan never changes. A freeze, an unfreeze, a re-partition or new bucket cuts make a
// new one with the next version, and the store lays its buffers out for it. OSS's holdings and
// state follow the version; ShardedDDP builds its buckets from the plan and rebuilds them when the
// version moves. The plan's trainable set is the one trainable mask shardopt keeps: OSS's step
// and ShardedDDP read it here, and compare it with the parameters' requires_grad to see a change.
struct ShardPlan {
  std::vector<uint8_t> trainable;  // one flag per parameter, in OSS's order
  Partition partition;             // the owner of each parameter kept whole
  FlatLayout layout;
  int64_t version = 0;  // counts the plans of one store
};

using PlanPtr = std::shared_ptr<const ShardPlan>;

}  // namespace shardopt::detail
