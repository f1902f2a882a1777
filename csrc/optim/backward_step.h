// Where OSS's step in a ShardedDDP's backward stands between its begin and step() (Note [A step
// in the backward] in oss_step_in_backward.cpp). Internal.
#pragma once

#include <shardopt/optim/oss.h>

#include "optim/shard_store.h"

#include <cstdint>
#include <utility>
#include <vector>

namespace shardopt::detail {

struct BackwardStep {
  // The rows the sync packs from the masters (Note [Syncing from the masters]).
  MasterRows from_masters;
  // This rank's holdings that step, by the layout bucket their parameter lies in; one list
  // more, last, for those in no bucket.
  std::vector<std::vector<std::pair<size_t, const Holding*>>> by_bucket;
  // Per layout bucket: whether it syncs on its own, as soon as it is stepped (a row bucket, or any
  // bucket under ParamSync::kBroadcast); the others go with the sync after the step.
  std::vector<uint8_t> syncs;
  std::vector<uint8_t> reduced;  // per layout bucket: handed over in this backward
  int64_t reduced_through = -1;  // every bucket up to it is reduced, and its holdings stepped
  size_t next_sync = 0;          // buckets below it have started their sync (or go after the step)
  bool ended = false;            // every bucket is reduced and stepped: step() finishes the sync
};

}  // namespace shardopt::detail
