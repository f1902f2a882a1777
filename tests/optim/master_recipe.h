// The reference for fp32 master weights (mixed precision, and the parameter wire): in one
// process, every rank's batch runs through copies of the fp32 masters rounded through
// `round_through` and computed in `dtype`; the gradients are summed in the reduction dtype over
// the ranks, averaged, unscaled, clipped, upcast, and plain torch::optim::Adam steps the masters.
#pragma once

#include <shardopt/optim/oss.h>

#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <cmath>
#include <optional>
#include <vector>

namespace shardopt::testing {

struct MasterRecipe {
  // Mixed precision: the copies are the masters in `dtype`. The parameter wire: the masters
  // rounded to bf16 (`round_through`), computed in fp32 (`dtype`), once a sync rounded them: a
  // parameter keeps its exact initial value until the first step it is trainable in.
  MasterRecipe(c10::ScalarType dtype, c10::ScalarType reduce, int world, double lr,
               std::optional<c10::ScalarType> round_through = std::nullopt)
      : dtype(dtype), round_through(round_through.value_or(dtype)), reduce(reduce), world(world),
        master(clone_params(make_params())), opt(master, torch::optim::AdamOptions(lr)),
        rounded(master.size(), !round_through.has_value()) {}

  // The copies forward and backward run on.
  at::Tensor copy_of(size_t i) const {
    return rounded[i] ? master[i].detach().to(round_through).to(dtype) : master[i].detach().to(dtype, false, true);
  }

  // One step of the global batch; `frozen` parameters get no gradient; loss_scale multiplies
  // the loss and is divided out in the reduction dtype; `skip` drops the step (non-finite).
  void step(int step, const std::vector<bool>& frozen, double clip, double loss_scale = 1.0, bool skip = false) {
    std::vector<at::Tensor> low;
    for (size_t i = 0; i < master.size(); ++i) low.push_back(copy_of(i).requires_grad_(!frozen[i]));
    std::vector<at::Tensor> sum(master.size());
    for (int r = 0; r < world; ++r) {
      for (auto& p : low) p.mutable_grad() = at::Tensor();
      const auto data = rank_data(step, r, 3);
      (loss_of(output(low, data.x.to(dtype)), data, 3) * loss_scale).backward();
      for (size_t i = 0; i < low.size(); ++i) {
        if (!low[i].grad().defined()) continue;
        const at::Tensor g = low[i].grad().to(reduce);
        sum[i] = sum[i].defined() ? sum[i] + g : g.clone();
      }
    }
    if (skip) return;
    at::NoGradGuard no_grad;
    double squares = 0.0;
    for (auto& g : sum) {
      if (!g.defined()) continue;
      g.div_(world);
      if (loss_scale != 1.0) g.mul_(1.0 / loss_scale);
      squares += std::pow(at::linalg_vector_norm(g, 2, c10::nullopt, false, at::kDouble).item<double>(), 2);
    }
    const double coef = clip / (std::sqrt(squares) + 1e-6);
    for (size_t i = 0; i < master.size(); ++i) {
      if (sum[i].defined() && clip > 0 && coef < 1.0) sum[i].mul_(coef);
      master[i].mutable_grad() = sum[i].defined() ? sum[i].to(at::kFloat) : at::Tensor();
      if (!frozen[i]) rounded[i] = true;  // the sync after this step rounds every trainable parameter
    }
    opt.step();
  }

  c10::ScalarType dtype, round_through, reduce;
  int world;
  std::vector<at::Tensor> master;
  torch::optim::Adam opt;
  std::vector<bool> rounded;  // per parameter: its copy is the rounded master
};

// The consolidated master weights (on rank 0; empty elsewhere), by parameter position.
inline std::vector<at::Tensor> consolidated_masters(OSS& oss, size_t n) {
  oss.consolidate_state_dict(0);
  std::vector<at::Tensor> out;
  if (oss.process_group().rank() != 0) return out;
  const auto sd = oss.state_dict().toGenericDict();
  EXPECT_TRUE(sd.contains("master_weights"));
  const auto masters = sd.at("master_weights").toGenericDict();
  for (size_t i = 0; i < n; ++i) out.push_back(masters.at(static_cast<int64_t>(i)).toTensor());
  return out;
}

}  // namespace shardopt::testing
