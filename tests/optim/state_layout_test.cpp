// A user's own optimizer, registered with shardopt::register_optimizer: an element-wise one (split
// like Adam's) and a whole-tensor one with a state entry of its own shape, each through a freeze
// that moves state, consolidation and a checkpoint loaded on another world size, against the same
// optimizer run in one process on the global batch. Without a registration it is refused, named.
#include <shardopt/optim/oss.h>
#include <shardopt/optim/state_layout.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <functional>
#include <torch/csrc/api/include/torch/arg.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/rmsprop.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <memory>
#include <string>
#include <vector>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

struct DecayOptions : public optim::OptimizerCloneableOptions<DecayOptions> {
  DecayOptions(double lr = 0.05) : lr_(lr) {}  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr);
  TORCH_ARG(double, beta) = 0.8;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct DecayState : public optim::OptimizerCloneableParamState<DecayState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, velocity);
  TORCH_ARG(at::Tensor, row_sq);  // the whole-tensor one's: one value per row
};

// Both test optimizers: v <- beta v + g for each parameter with a gradient, then update().
class WithVelocity : public optim::Optimizer {
 public:
  WithVelocity(const std::vector<optim::OptimizerParamGroup>& groups, DecayOptions defaults)
      : Optimizer(groups, std::make_unique<DecayOptions>(defaults)) {}
  at::Tensor step(LossClosure = nullptr) override {
    at::NoGradGuard no_grad;
    for (auto& group : param_groups_) {
      const auto& o = static_cast<const DecayOptions&>(group.options());
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) slot = fresh(p);
        auto& s = static_cast<DecayState&>(*slot);
        s.step(s.step() + 1);
        s.velocity().mul_(o.beta()).add_(p.grad());
        update(p, o, s);
      }
    }
    return {};
  }

 protected:
  virtual std::unique_ptr<DecayState> fresh(const at::Tensor& p) const = 0;
  virtual void update(at::Tensor& p, const DecayOptions& o, DecayState& s) const = 0;
};

// Element-wise: p <- p - lr tanh(v) / sqrt(step).
class TanhMomentum : public WithVelocity {
 public:
  using WithVelocity::WithVelocity;

 protected:
  std::unique_ptr<DecayState> fresh(const at::Tensor& p) const override {
    return std::make_unique<DecayState>(DecayState().velocity(at::zeros_like(p)));
  }
  void update(at::Tensor& p, const DecayOptions& o, DecayState& s) const override {
    p.add_(at::tanh(s.velocity()), -o.lr() / std::sqrt(static_cast<double>(s.step())));
  }
};

// Whole-tensor: r <- beta r + (1 - beta) (sum of g^2 over each row); p <- p - lr v / sqrt(r + 1e-3)
// row by row. r has one value per row: it needs the whole parameter.
class RowScaled : public WithVelocity {
 public:
  using WithVelocity::WithVelocity;

 protected:
  std::unique_ptr<DecayState> fresh(const at::Tensor& p) const override {
    return std::make_unique<DecayState>(
        DecayState().velocity(at::zeros_like(p)).row_sq(at::zeros({p.size(0)}, p.options())));
  }
  void update(at::Tensor& p, const DecayOptions& o, DecayState& s) const override {
    const at::Tensor g = p.grad().reshape({p.size(0), -1});
    s.row_sq().mul_(o.beta()).add_(g.pow(2).sum(1), 1 - o.beta());
    const at::Tensor scale = (s.row_sq() + 1e-3).rsqrt().reshape({p.size(0), 1});
    p.add_((s.velocity().reshape({p.size(0), -1}) * scale).reshape(p.sizes()), -o.lr());
  }
};

void register_both() {
  using Tanh = OptimizerRegistration<TanhMomentum, DecayOptions, DecayState>;
  register_optimizer(Tanh("TanhMomentum", StateKind::kElementWise)
                         .option("lr", [](DecayOptions& o) -> double& { return o.lr(); })
                         .option("beta", [](DecayOptions& o) -> double& { return o.beta(); })
                         .step([](DecayState& s) -> int64_t& { return s.step(); })
                         .tensor("velocity", [](DecayState& s) -> at::Tensor& { return s.velocity(); }));
  using Row = OptimizerRegistration<RowScaled, DecayOptions, DecayState>;
  register_optimizer(Row("RowScaled", StateKind::kWholeTensor)
                         .option("lr", [](DecayOptions& o) -> double& { return o.lr(); })
                         .option("beta", [](DecayOptions& o) -> double& { return o.beta(); })
                         .step([](DecayState& s) -> int64_t& { return s.step(); })
                         .tensor("velocity", [](DecayState& s) -> at::Tensor& { return s.velocity(); })
                         .tensor("row_sq", [](DecayState& s) -> at::Tensor& { return s.row_sq(); },
                                 [](at::IntArrayRef sizes) { return std::vector<int64_t>{sizes[0]}; }));
}

constexpr int kBatch = 12;  // the global batch: 6 per rank at world 2, 4 at world 3

// Parameter 0 (the first weight) is frozen for steps 2 and 3.
void set_trainable(Params& params, int step) {
  params[0].requires_grad_(step < 2 || step >= 4);
}

template <class Opt>
void check_registered(const char* name) {
  // The reference: the optimizer alone in one process, on the global batch, 6 steps.
  Params ref = testing::make_params(7);
  for (auto& p : ref) p.requires_grad_(true);
  Opt ref_opt({optim::OptimizerParamGroup(ref)}, DecayOptions());
  std::vector<Params> ref_after;
  c10::impl::GenericDict ref_state_after_4(c10::IntType::get(), c10::AnyType::get());
  for (int step = 0; step < 6; ++step) {
    set_trainable(ref, step);
    ref_opt.zero_grad(true);
    testing::loss(ref, testing::global_data(step, 0, kBatch), kBatch).backward();
    ref_opt.step();
    ref_after.push_back(testing::clone_params(ref));
    if (step != 3) continue;
    for (size_t i = 0; i < ref.size(); ++i) {
      const auto& s = static_cast<const DecayState&>(*ref_opt.state().at(ref[i].unsafeGetTensorImpl()));
      ref_state_after_4.insert(static_cast<int64_t>(i), s.velocity().clone());
    }
  }

  std::vector<char> saved;
  Params params_after_4;
  // Steps 0-3 at world 2, the state moving with the freeze (whole parameters: the first weight
  // frozen leaves one rank without work, and the largest one left moves to it); then a checkpoint.
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = testing::make_params(7);
    for (auto& p : params) p.requires_grad_(true);
    OSS oss(params, optimizer<Opt>(DecayOptions()), g);
    for (int step = 0; step < 4; ++step) {
      set_trainable(params, step);
      const auto data = testing::rank_data(step, g->rank(), kBatch / 2);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << name;
      oss.zero_grad();
      testing::loss(params, data, kBatch / 2).backward();
      testing::allreduce_grads(params, *g);
      oss.step();
      ASSERT_TRUE(testing::matches_reference(params, ref_after[step], *g, 1e-5)) << name << ", step " << step;
    }
    EXPECT_GE(Introspection::state_moves(oss), 1) << name << ": the freeze moved no state\n" << oss.describe();
    oss.consolidate_state_dict(0);
    if (g->rank() != 0) return;
    const auto state = oss.state_dict().toGenericDict().at("state").toGenericDict();
    ASSERT_EQ(state.size(), ref.size()) << name;
    for (size_t i = 0; i < ref.size(); ++i) {
      const auto entry = state.at(static_cast<int64_t>(i)).toGenericDict();
      EXPECT_EQ(entry.at("step").toTensor().item<double>(), i == 0 ? 2.0 : 4.0) << name << ", parameter " << i;
      const at::Tensor want = ref_state_after_4.at(static_cast<int64_t>(i)).toTensor();
      EXPECT_LE(testing::rel_diff(entry.at("velocity").toTensor(), want), 1e-5) << name << ", parameter " << i;
      if (std::string(name) == "RowScaled") {
        EXPECT_EQ(entry.at("row_sq").toTensor().sizes(), at::IntArrayRef{ref[i].size(0)}) << name;
      }
    }
    saved = torch::pickle_save(oss.state_dict());
    params_after_4 = testing::clone_params(params);
  });
  if (::testing::Test::HasFatalFailure()) return;
  // Steps 4-5 at world 3 from the checkpoint.
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = testing::clone_params(params_after_4);
    for (auto& p : params) p.requires_grad_(true);
    OSS oss(params, optimizer<Opt>(DecayOptions()), g);
    oss.load_state_dict(torch::pickle_load(saved));
    for (int step = 4; step < 6; ++step) {
      set_trainable(params, step);
      const auto data = testing::rank_data(step, g->rank(), kBatch / 3);
      oss.zero_grad();
      testing::loss(params, data, kBatch / 3).backward();
      testing::allreduce_grads(params, *g);
      oss.step();
      ASSERT_TRUE(testing::matches_reference(params, ref_after[step], *g, 1e-5)) << name << ", step " << step;
    }
  });
}

TEST(StateLayout, RegisteredElementWiseOptimizerSplitsMovesConsolidatesAndResumesOnAnotherWorldSize) {
  register_both();
  check_registered<TanhMomentum>("TanhMomentum");
}

TEST(StateLayout, RegisteredWholeTensorOptimizerKeepsItsShapesThroughMovesAndCheckpoints) {
  register_both();
  check_registered<RowScaled>("RowScaled");
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = testing::make_params(7);
    OSS oss(params, optimizer<RowScaled>(DecayOptions()), g, OSSOptions().partition(PartitionMode::kSplit));
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_TRUE(Introspection::kept_whole(oss, i));
      EXPECT_EQ(oss.owners(params[i]).size(), 1u) << "parameter " << i;
    }
  });
}

// A registered option is compared across ranks as torch::optim's are (Note [Optimizers agree
// across ranks]): a rank built with another beta fails on every rank, naming it.
TEST(StateLayout, ARegisteredOptimizersOptionThatDiffersOnOneRankIsNamedOnEveryRank) {
  register_both();
  const auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss(testing::make_params(7), optimizer<TanhMomentum>(DecayOptions().beta(g->rank() == 1 ? 0.5 : 0.8)), g);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("ranks disagree on param group 0's beta (TanhMomentum): 0.8 on rank 0 but 0.5 on rank 1"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

class Unregistered : public TanhMomentum {
  using TanhMomentum::TanhMomentum;
};

TEST(StateLayout, AnUnregisteredOptimizerIsRefusedNamedAndBadRegistrationsAreErrors) {
  const auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss(testing::make_params(7), optimizer<Unregistered>(DecayOptions()), g);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("Unregistered"), std::string::npos) << e;
    EXPECT_NE(e.find("register_optimizer"), std::string::npos) << e;
  }
  using Bad = OptimizerRegistration<Unregistered, DecayOptions, DecayState>;
  try {
    register_optimizer(Bad("Bad", StateKind::kElementWise)
                           .tensor("row_sq", [](DecayState& s) -> at::Tensor& { return s.row_sq(); },
                                   [](at::IntArrayRef sizes) { return std::vector<int64_t>{sizes[0]}; }));
    FAIL() << "an element-wise optimizer with a state entry of its own shape was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("row_sq"), std::string::npos) << e.what();
  }
  using Adam = OptimizerRegistration<optim::Adam, optim::AdamOptions, optim::AdamParamState>;
  EXPECT_THROW(register_optimizer(Adam("Adam", StateKind::kElementWise)), c10::Error);
}

// constant(name, value): a key every saved group carries (one the Python class has and the C++
// one does not), beside the registered options.
class WithConstants : public TanhMomentum {
  using TanhMomentum::TanhMomentum;
};

TEST(StateLayout, AConstantIsAKeyEverySavedGroupCarries) {
  using Reg = OptimizerRegistration<WithConstants, DecayOptions, DecayState>;
  register_optimizer(Reg("WithConstants", StateKind::kElementWise)
                         .option("lr", [](DecayOptions& o) -> double& { return o.lr(); })
                         .option("beta", [](DecayOptions& o) -> double& { return o.beta(); })
                         .constant("foreach", c10::IValue(false))
                         .constant("maximize", c10::IValue(false))
                         .step([](DecayState& s) -> int64_t& { return s.step(); })
                         .tensor("velocity", [](DecayState& s) -> at::Tensor& { return s.velocity(); }));
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = testing::make_params(7);
    OSS oss({{{params[0], params[1]}, optimizer<WithConstants>(DecayOptions(0.1))},
             {{params[2], params[3], params[4]}, optimizer<WithConstants>(DecayOptions(0.2))}},
            g);
    oss.consolidate_state_dict(0);
    if (g->rank() != 0) return;
    const auto groups = oss.state_dict().toGenericDict().at("param_groups").toListRef();
    ASSERT_EQ(groups.size(), 2u);
    for (size_t k = 0; k < groups.size(); ++k) {
      const auto group = groups[k].toGenericDict();
      ASSERT_TRUE(group.contains("foreach") && group.contains("maximize")) << "group " << k;
      EXPECT_FALSE(group.at("foreach").toBool()) << "group " << k;
      EXPECT_FALSE(group.at("maximize").toBool()) << "group " << k;
      EXPECT_DOUBLE_EQ(group.at("lr").toDouble(), k == 0 ? 0.1 : 0.2) << "group " << k;
      EXPECT_DOUBLE_EQ(group.at("beta").toDouble(), 0.8) << "group " << k;
    }
  });
}

// compressible() takes only a tensor registered before it and shaped like its parameter;
// knows_optimizer() says which optimizers OSS has a layout for.
TEST(StateLayout, CompressibleTakesOnlyRegisteredParameterShapedTensorsAndKnowsOptimizerSaysWhatIsKnown) {
  using Row = OptimizerRegistration<Unregistered, DecayOptions, DecayState>;
  auto error_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const c10::Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string unknown = error_of([] { Row("R", StateKind::kElementWise).compressible("velocity"); });
  EXPECT_NE(unknown.find("compressible('velocity') names no state tensor registered before it"), std::string::npos)
      << unknown;
  const std::string shaped = error_of([] {
    Row("R", StateKind::kWholeTensor)
        .tensor("row_sq", [](DecayState& s) -> at::Tensor& { return s.row_sq(); },
                [](at::IntArrayRef sizes) { return std::vector<int64_t>{sizes[0]}; })
        .compressible("row_sq", StateCodes::kUnsigned);
  });
  EXPECT_NE(shaped.find("state entry 'row_sq' has a shape of its own"), std::string::npos) << shaped;

  register_both();
  const Params params = testing::make_params(7);
  EXPECT_TRUE(knows_optimizer(optim::Adam(params, optim::AdamOptions(1e-3))));
  EXPECT_TRUE(knows_optimizer(optim::SGD(params, optim::SGDOptions(1e-3))));
  EXPECT_TRUE(knows_optimizer(TanhMomentum({optim::OptimizerParamGroup(params)}, DecayOptions())));
  EXPECT_FALSE(knows_optimizer(Unregistered({optim::OptimizerParamGroup(params)}, DecayOptions())));
  EXPECT_TRUE(knows_optimizer(optim::RMSprop(params, optim::RMSpropOptions(1e-3))));
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
