// Agreement across ranks on the trainable mask (one requires_grad flag per parameter).
// Internal to shardopt.
#pragma once

#include <shardopt/comm/process_group.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace shardopt::detail {

// The current requires_grad flags of `params`.
std::vector<uint8_t> trainable_mask(const std::vector<at::Tensor>& params);

// A hash of the mask, the same on every rank for the same mask.
uint64_t mask_hash(const std::vector<uint8_t>& mask);

// Checks that every rank holds the same `mask`: one 16-byte all-reduce of a hash (or, with
// `exhaustive`, a full all-gather). When ranks differ, every rank throws an error naming the
// first differing parameter (through `name(i)`) and the two ranks. Collective.
void agree_on_mask(ProcessGroup& group, const std::vector<uint8_t>& mask, bool exhaustive,
                   const std::function<std::string(size_t)>& name);

}  // namespace shardopt::detail
