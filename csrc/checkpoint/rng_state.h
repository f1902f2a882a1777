// The random-number state a checkpoint carries: every rank's default CPU generator, saved on
// rank 0 and restored per rank. Internal.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>

#include <vector>

namespace shardopt {
class ProcessGroup;
}

namespace shardopt::detail {

// Sets this process's default CPU generator's state.
void set_rng_state(const at::Tensor& state);

// Every rank's generator state, on rank 0 (empty elsewhere). Collective.
std::vector<c10::IValue> gather_rng_states(ProcessGroup& group);

// Whether this rank restores the process's generator state: the default CPU generator is one per
// process, so where ranks are threads of one process only the lowest of them sets it (to its own
// saved state), instead of each in turn, racing. Collective.
bool restores_rng(ProcessGroup& group);

}  // namespace shardopt::detail
