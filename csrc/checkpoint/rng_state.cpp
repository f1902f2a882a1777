#include "checkpoint/rng_state.h"

#include <shardopt/comm/process_group.h>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <mutex>
#include <random>

namespace shardopt::detail {

namespace {

// A number drawn once per process: ranks that report the same one are threads of one process.
int64_t process_token() {
  static const int64_t token = [] {
    std::random_device device;
    return static_cast<int64_t>((static_cast<uint64_t>(device()) << 32) ^ device());
  }();
  return token;
}

// A copy of this process's default CPU generator's state.
at::Tensor rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::Tensor(gen.get_state()).clone();
}

}  // namespace

void set_rng_state(const at::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::vector<c10::IValue> gather_rng_states(ProcessGroup& group) {
  const int rank = group.rank();
  std::vector<c10::IValue> states;
  for (int r = 0; r < group.size(); ++r) {
    if (r == 0) {
      if (rank == 0) states.emplace_back(rng_state());
    } else if (rank == r) {
      group.send_bytes(torch::jit::pickle_save(rng_state()), 0, r);
    } else if (rank == 0) {
      states.push_back(torch::jit::pickle_load(group.recv_bytes(r, r)));
    }
  }
  return states;
}

bool restores_rng(ProcessGroup& group) {
  const auto tokens = group.allgather_ints({process_token()});
  for (int r = 0; r < group.rank(); ++r) {
    if (tokens[r][0] == tokens[group.rank()][0]) return false;
  }
  return true;
}

}  // namespace shardopt::detail
