// Agreement across ranks on the trainable mask (one requires_grad flag per parameter).
// Internal to shardopt; OSS and ShardedDDP both use it.
#pragma once

#include <shardopt/comm/agree.h>
#include <shardopt/comm/process_group.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shardopt::detail {

// The current requires_grad flags of `params`.
std::vector<uint8_t> trainable_mask(const std::vector<at::Tensor>& params);

// The agreement on `mask`: one field per parameter, named by `name(i)`. Its hash() is what the
// overlapped check of ShardedDDP compares.
Agreement mask_agreement(const std::vector<uint8_t>& mask, const std::function<std::string(size_t)>& name);

// Checks that every rank holds the same `mask`: one 16-byte all-reduce of a hash (or, with
// `exhaustive`, a full all-gather). When ranks differ, every rank throws an error naming the
// first differing parameter and the ranks on each side. Collective.
void agree_on_mask(ProcessGroup& group, const std::vector<uint8_t>& mask, bool exhaustive,
                   const std::function<std::string(size_t)>& name);

}  // namespace shardopt::detail
