#include "optim/trainable.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

namespace shardopt::detail {

std::vector<uint8_t> trainable_mask(const std::vector<at::Tensor>& params) {
  std::vector<uint8_t> mask(params.size());
  for (size_t i = 0; i < params.size(); ++i) mask[i] = params[i].requires_grad();
  return mask;
}

uint64_t mask_hash(const std::vector<uint8_t>& mask) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (uint8_t m : mask) h = (h ^ m) * 1099511628211ull;
  return h ^ mask.size();
}

void agree_on_mask(ProcessGroup& group, const std::vector<uint8_t>& mask, bool exhaustive,
                   const std::function<std::string(size_t)>& name) {
  if (group.size() == 1) return;
  if (!exhaustive) {
    // max(h) == -max(-h) exactly when every rank has the same hash.
    const auto h = static_cast<int64_t>(mask_hash(mask) >> 1);
    at::Tensor t = at::tensor({h, -h}, at::kLong);
    group.allreduce(t, Reduction::kMax);
    if (t[0].item<int64_t>() == -t[1].item<int64_t>()) return;
  }
  auto all = group.allgather_ints(std::vector<int64_t>(mask.begin(), mask.end()));
  for (int r = 1; r < group.size(); ++r) {
    TORCH_CHECK(all[r].size() == all[0].size(), "shardopt: ranks disagree on the number of parameters: ",
                all[0].size(), " on rank 0 but ", all[r].size(), " on rank ", r);
    for (size_t i = 0; i < mask.size(); ++i) {
      TORCH_CHECK(all[r][i] == all[0][i], "shardopt: ranks disagree on the trainable set: ", name(i),
                  " has requires_grad=", all[0][i] ? "true" : "false", " on rank 0 but ",
                  all[r][i] ? "true" : "false", " on rank ", r, "; freeze and unfreeze the same parameters on every rank");
    }
  }
}

}  // namespace shardopt::detail
