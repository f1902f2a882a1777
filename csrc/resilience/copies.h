// The copies a resilient run keeps (Note [Buddy copies] in resilient.cpp), and the helpers that
// make and move them. Internal: resilient.cpp and replacement.cpp share them.
#pragma once

#include <shardopt/comm/process_group.h>
#include <shardopt/resilience/resilient.h>

#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardopt {

namespace detail {

// Host copies of `tensors`.
std::vector<at::Tensor> host_copies(const std::vector<at::Tensor>& tensors);
// Bytes as an owned byte tensor, and back.
at::Tensor bytes_tensor(const std::vector<char>& bytes);
std::vector<char> tensor_bytes(const at::Tensor& t);
// Sends `mine` to rank `to` and returns what rank `from` sent (even ranks send first).
std::vector<char> pass_along(ProcessGroup& group, const std::vector<char>& mine, int to, int from);
// `value` with every tensor in it copied to host memory, and the bytes of those tensors.
c10::IValue to_host(const c10::IValue& value);
int64_t host_bytes(const c10::IValue& value);
// "1", "1 and 3", "0, 1 and 3".
std::string ranks_text(const std::vector<int>& ranks);

}  // namespace detail

// One refresh's copies on this rank.
struct Resilient::Copy {
  int64_t step = -1;
  std::vector<at::Tensor> params, buffers;
  c10::IValue own;           // this rank's shard (OSS::state_shard()), its tensors copied to host memory
  std::vector<char> buddy;   // the buddy's, serialized as it came
  bool has_buddy = false;
  int64_t bytes() const {
    int64_t n = static_cast<int64_t>(buddy.size()) + detail::host_bytes(own);
    for (const auto& t : params) n += t.nbytes();
    for (const auto& t : buffers) n += t.nbytes();
    return n;
  }
};

}  // namespace shardopt
