// Moving optimizer state between owners when the partition changes (Note [Rebalance after a
// freeze] in oss.cpp). Internal to shardopt.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/optim/partition.h>

#include "optim/codec.h"

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace shardopt {
struct RebalanceStats;
}

namespace shardopt::detail {

// An encoded state (state_dict layout) decoded with its tensors next to `param`, in its dtype.
std::unique_ptr<torch::optim::OptimizerParamState> decode_state_like(const OptimizerCodec& codec,
                                                                     const GenericDict& encoded,
                                                                     const at::Tensor& param);

// Each parameter whose owner differs between `from` and `to` takes its optimizer state in
// `local` (the wrapped optimizer of this rank), and any gradient its old owner holds, to its new
// owner: serialized with `local`'s codec, one pair of ranks at a time in the same order on every
// rank. Counts what moved in `stats`. Collective.
void migrate_state(ProcessGroup& group, torch::optim::Optimizer& local, std::vector<at::Tensor>& params,
                   const Partition& from, const Partition& to, RebalanceStats& stats);

}  // namespace shardopt::detail
