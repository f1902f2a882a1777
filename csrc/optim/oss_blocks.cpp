// OSS's hierarchical sharding: blocks of ranks and their replica groups.
#include <shardopt/optim/oss.h>
#include <shardopt/check.h>
#include <shardopt/comm/agree.h>

#include <vector>

namespace shardopt {

// Note [Hierarchical sharding]
// Blocks of n consecutive ranks each hold one copy of the state, sharded n ways; the ranks at one
// position of every block form a replica group. Every rank calls split() for every block and
// every replica group, in the same order, and keeps the ones it belongs to. From then on the
// partition, layout, parameter sync and consolidation are those of the block (group_); the
// trainable set is agreed over the whole group (global_group_), and ShardedDDP all-reduces each
// owned, block-reduced gradient across the replica group.
void OSS::form_blocks() {
  global_group_ = group_;
  const int world = group_->size(), n = options_.shard_group_size();
  SHARDOPT_CHECK(n >= 0 && n <= world && (n == 0 || world % n == 0), "OSSOptions::shard_group_size ", n,
                 " must divide the group's size ", world, " (0: the whole group)");
  if (world > 1) {
    Agreement("OSS").field("shard_group_size", n == world ? 0 : n).hint("every rank must pass the same shard_group_size").check(*group_);
  }
  if (n == 0 || n == world) return;
  std::shared_ptr<ProcessGroup> block;
  for (int b = 0; b < world / n; ++b) {
    std::vector<int> ranks;
    for (int i = 0; i < n; ++i) ranks.push_back(b * n + i);
    if (auto g = global_group_->split(ranks)) block = g;
  }
  for (int i = 0; i < n; ++i) {
    std::vector<int> ranks;
    for (int b = 0; b < world / n; ++b) ranks.push_back(b * n + i);
    if (auto g = global_group_->split(ranks)) replica_group_ = g;
  }
  group_ = block;
}

}  // namespace shardopt
