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

// Host copies of `tensors`, into `reuse`'s tensors where they match in number, shape and dtype
// (an older copy's memory: its pages are already in place).
std::vector<at::Tensor> host_copies(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor> reuse = {});
// Bytes as an owned byte tensor, and back.
at::Tensor bytes_tensor(const std::vector<char>& bytes);
std::vector<char> tensor_bytes(const at::Tensor& t);

// Note [Flat copies]
// A shard's copy is one host byte tensor holding every tensor of the shard, each at a multiple of
// 64 bytes, and its structure: the shard with each tensor replaced by an empty one of its dtype
// (so every container keeps its type), pickled, with each tensor's offset and sizes. Making it
// copies each tensor once; sending it sends the byte tensor as it is (no pickling of the data,
// no copy into or out of a byte vector); the shard is rebuilt, as views of the bytes, only when a
// recovery needs it.
struct FlatCopy {
  std::vector<char> structure;
  at::Tensor bytes;  // kByte, on the host
  int64_t nbytes() const { return static_cast<int64_t>(structure.size()) + (bytes.defined() ? bytes.numel() : 0); }
};
// `reuse`: a byte tensor the bytes go into when it has their size exactly.
FlatCopy flatten(const c10::IValue& value, at::Tensor reuse = {});
c10::IValue unflatten(const FlatCopy& copy);
// Sends `mine` to rank `to` and returns what rank `from` sent, both ways at once; the bytes that
// come go into `reuse` when it has their size exactly.
FlatCopy pass_along(ProcessGroup& group, const FlatCopy& mine, int to, int from, at::Tensor reuse = {});
// Sends `copy` from `root` to every rank of `group` (the others' `copy` is replaced).
void broadcast_copy(ProcessGroup& group, FlatCopy& copy, int root);
// "1", "1 and 3", "0, 1 and 3".
std::string ranks_text(const std::vector<int>& ranks);

}  // namespace detail

// One refresh's copies on this rank.
struct Resilient::Copy {
  int64_t step = -1;
  std::vector<at::Tensor> params, buffers;
  detail::FlatCopy own;      // this rank's shard (OSS::state_shard()), in host memory (Note [Flat copies])
  detail::FlatCopy buddy;    // the buddy's, as it came
  bool has_buddy = false;
  double loss_scale = 0;            // ResilienceOptions::grad_scaler's, at the refresh
  int64_t growth_tracker = 0;
  int64_t bytes() const {
    int64_t n = own.nbytes() + buddy.nbytes();
    for (const auto& t : params) n += t.nbytes();
    for (const auto& t : buffers) n += t.nbytes();
    return n;
  }
};

}  // namespace shardopt
