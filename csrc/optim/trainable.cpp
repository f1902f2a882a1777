#include "optim/trainable.h"

#include <ATen/ATen.h>

namespace shardopt::detail {

std::vector<uint8_t> trainable_mask(const std::vector<at::Tensor>& params) {
  std::vector<uint8_t> mask(params.size());
  for (size_t i = 0; i < params.size(); ++i) mask[i] = params[i].requires_grad();
  return mask;
}

Agreement mask_agreement(const std::vector<uint8_t>& mask, const std::function<std::string(size_t)>& name) {
  Agreement agreement;
  agreement.field("the number of parameters", static_cast<int64_t>(mask.size()))
      .each(std::vector<int64_t>(mask.begin(), mask.end()), name,
            [](const std::vector<int64_t>& v) { return std::string("requires_grad=") + (v[0] ? "true" : "false"); })
      .hint("the trainable set must be the same on every rank: freeze and unfreeze the same parameters everywhere");
  return agreement;
}

void agree_on_mask(ProcessGroup& group, const std::vector<uint8_t>& mask, bool exhaustive,
                   const std::function<std::string(size_t)>& name) {
  mask_agreement(mask, name).check(group, exhaustive ? Agreement::Mode::kExact : Agreement::Mode::kHashFirst);
}

}  // namespace shardopt::detail
