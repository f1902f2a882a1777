#include "optim/param_buffers.h"

#include <shardopt/check.h>
#include <shardopt/optim/oss.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/grad_mode.h>

namespace shardopt::detail {

std::vector<at::Tensor> lay_out_params(const FlatLayout& layout, std::vector<at::Tensor>& params) {
  TORCH_INTERNAL_ASSERT(layout.num_params() == params.size(), "layout of ", layout.num_params(), " parameters for ",
                        params.size());
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> buffers;
  for (const auto& group : layout.groups()) {
    buffers.push_back(at::zeros({group.buffer_numel()},
                                at::TensorOptions().dtype(group.dtype).device(group.device)));
  }
  for (size_t i = 0; i < params.size(); ++i) {
    auto& p = params[i];
    // A parameter's pieces are adjacent: it stays one view, whatever its owners.
    const Range at = layout.param_in_buffer(i);
    TORCH_INTERNAL_ASSERT(at.size() == p.numel(), "parameter ", i, " has ", p.numel(), " elements, its range ",
                          at.size());
    const size_t group = layout.pieces()[layout.pieces_of(i).front()].group;
    at::Tensor view = buffers[group].narrow(0, at.begin, at.size()).view(p.sizes());
    view.copy_(p.detach());
    p.set_data(view);
  }
  return buffers;
}

void sync_params(ProcessGroup& group, const FlatLayout& layout, std::vector<at::Tensor>& buffers, ParamSync mode) {
  const int world = group.size();
  if (world == 1) return;
  at::NoGradGuard no_grad;
  auto shard = [&](size_t g, int owner) {
    const Range r = layout.groups()[g].shard_in_buffer(owner);
    return buffers[g].narrow(0, r.begin, r.size());
  };
  if (mode == ParamSync::kBroadcast) {
    std::vector<PendingWork> pending;
    for (size_t g = 0; g < buffers.size(); ++g) {
      for (int r = 0; r < world; ++r) {
        // Only the elements the owner's pieces occupy: a whole-parameter shard's padding up to
        // the longest shard is never sent.
        const int64_t used = layout.groups()[g].used[r];
        if (used == 0) continue;
        at::Tensor segment = shard(g, r).narrow(0, 0, used);
        pending.push_back(group.broadcast_async(segment, r));
      }
    }
    for (auto& w : pending) w.wait();
    return;
  }
  for (size_t g = 0; g < buffers.size(); ++g) {
    std::vector<at::Tensor> shards;
    for (int r = 0; r < world; ++r) shards.push_back(shard(g, r));
    // The input is copied: it must not alias the output it is gathered into.
    at::Tensor mine = shards[group.rank()].clone();
    group.allgather(shards, mine);
  }
}

}  // namespace shardopt::detail
