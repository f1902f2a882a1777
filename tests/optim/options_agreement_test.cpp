// Optimizers that differ across ranks (Note [Optimizers agree across ranks] in
// csrc/optim/options_agreement.cpp): every option of each optimizer shardopt ships, on one rank.
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim.h>

#include <functional>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

// Note [Optimizers agree across ranks]: a rank that builds its optimizer with another option or
// another class, or changes param_groups() alone, fails on every rank, naming the group, the option
// and each rank's value; a learning-rate change made on every rank alike steps on.
TEST(OSS, RanksWhoseOptimizersDifferFailNamingTheOptionOnEveryRank) {
  const auto expect_on_both = [](const std::vector<std::string>& errors, const std::string& needle) {
    for (int r = 0; r < 2; ++r) {
      EXPECT_THAT(errors[r], ::testing::HasSubstr(needle)) << "rank " << r;
      EXPECT_THAT(errors[r], ::testing::HasSubstr("every rank must build its optimizers alike")) << "rank " << r;
    }
  };
  auto lr = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss(testing::make_params(), optimizer<optim::Adam>(optim::AdamOptions(g->rank() == 0 ? 1e-3 : 2e-3)), g);
  });
  expect_on_both(lr, "ranks disagree on param group 0's lr (Adam): 0.001 on rank 0 but 0.002 on rank 1");
  auto kind = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    if (g->rank() == 1) {
      OSS oss(p, optimizer<optim::SGD>(optim::SGDOptions(1e-3)), g);
    } else {
      OSS oss(p, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    }
  });
  expect_on_both(kind, "ranks disagree on param group 0's optimizer: Adam on rank 0 but SGD on rank 1");
  // Every other option each shipped optimizer has, one at a time: rank 1 builds with another value.
  struct Differ {
    std::string needle;
    std::function<OptimizerFactory(bool)> factory;  // the argument: this is rank 1
    bool matrices_only;                             // Muon: the 2-D parameters
  };
  const std::vector<Differ> differ = {
      {"betas (Adam): (0.9, 0.999) on rank 0 but (0.8, 0.999) on rank 1",
       [](bool one) { return optimizer<optim::Adam>(optim::AdamOptions(1e-3).betas({one ? 0.8 : 0.9, 0.999})); }},
      {"eps (AdamW): 1e-08 on rank 0 but 1e-06 on rank 1",
       [](bool one) { return optimizer<optim::AdamW>(optim::AdamWOptions(1e-3).eps(one ? 1e-6 : 1e-8)); }},
      {"amsgrad (Adam): false on rank 0 but true on rank 1",
       [](bool one) { return optimizer<optim::Adam>(optim::AdamOptions(1e-3).amsgrad(one)); }},
      {"momentum (SGD): 0.9 on rank 0 but 0.5 on rank 1",
       [](bool one) { return optimizer<optim::SGD>(optim::SGDOptions(1e-2).momentum(one ? 0.5 : 0.9)); }},
      {"dampening (SGD): 0 on rank 0 but 0.1 on rank 1",
       [](bool one) { return optimizer<optim::SGD>(optim::SGDOptions(1e-2).momentum(0.9).dampening(one ? 0.1 : 0)); }},
      {"nesterov (SGD): true on rank 0 but false on rank 1",
       [](bool one) { return optimizer<optim::SGD>(optim::SGDOptions(1e-2).momentum(0.9).nesterov(!one)); }},
      {"momentum (Muon): 0.95 on rank 0 but 0.9 on rank 1",
       [](bool one) { return optimizer<Muon>(MuonOptions(0.02).momentum(one ? 0.9 : 0.95)); }, true},
      {"ns_steps (Muon): 5 on rank 0 but 3 on rank 1",
       [](bool one) { return optimizer<Muon>(MuonOptions(0.02).ns_steps(one ? 3 : 5)); }, true},
      {"adjust_lr_fn (Muon): original on rank 0 but match_rms_adamw on rank 1",
       [](bool one) { return optimizer<Muon>(MuonOptions(0.02).adjust_lr_fn(one ? "match_rms_adamw" : "original")); },
       true},
  };
  for (const Differ& d : differ) {
    SCOPED_TRACE(d.needle);
    auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      Params p = testing::make_params();
      if (d.matrices_only) p = {p[0], p[2]};
      OSS oss(p, d.factory(g->rank() == 1), g);
    });
    expect_on_both(errors, "ranks disagree on param group 0's " + d.needle);
  }

  // After construction: every rank lowers the learning rate alike (a scheduler) and steps on; then
  // rank 1 alone changes the weight decay, and the next step fails before it steps.
  std::vector<Params> after(2);
  auto changed = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    for (int step = 0; step < 3; ++step) {
      for (auto& t : p) t.mutable_grad() = at::full_like(t, 0.1 * (step + 1));
      if (step == 1) static_cast<optim::AdamOptions&>(oss.param_groups()[0].options()).lr(5e-4);
      if (step == 2 && g->rank() == 1) static_cast<optim::AdamOptions&>(oss.param_groups()[0].options()).weight_decay(0.1);
      if (step == 2) after[g->rank()] = testing::clone_params(p);
      oss.step();
    }
  });
  expect_on_both(changed, "ranks disagree on param group 0's weight_decay (Adam): 0 on rank 0 but 0.1 on rank 1");
  for (size_t i = 0; i < after[0].size(); ++i) {
    EXPECT_TRUE(at::equal(after[0][i], after[1][i])) << "the ranks stepped apart before the change, parameter " << i;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
