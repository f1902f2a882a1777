// OSS with parameters split across owners (PartitionMode kSplit, the default for element-wise
// optimizers), on a model whose one tensor holds over 90% of the elements.
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim.h>

#include <limits>
#include <mutex>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

constexpr size_t kA = 0, kD = 1;  // the dominant tensor is D

// The four ways of clearing gradients, one per step in turn.
void clear(int step, OSS& oss, Params& p) {
  switch (step % 4) {
    case 0: oss.zero_grad(true); break;
    case 1: oss.zero_grad(false); break;
    case 2: for (auto& t : p) t.mutable_grad().reset(); break;
    default:
      for (auto& t : p) {
        if (t.grad().defined()) t.grad().zero_();
      }
  }
}

struct SplitParity {
  int world = 2;
  int steps = 8;
  OptimizerFactory factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));

  void run() const {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      Params init = testing::make_dominant_params();
      Params ref = testing::clone_params(init), mine = testing::clone_params(init);
      auto ref_opt = factory({optim::OptimizerParamGroup(ref)});
      OSS oss(mine, factory, g);
      ASSERT_TRUE(Introspection::split(oss)) << oss.describe();
      EXPECT_EQ(oss.owners(mine[kD]).size(), static_cast<size_t>(world)) << "D spans every rank";
      EXPECT_EQ(oss.owner(mine[kD]), -1);
      if (world >= 3) {
        // A rank in the middle of D owns no whole parameter.
        for (const auto& p : mine) EXPECT_NE(oss.owner(p), 1);
      }
      for (int step = 0; step < steps; ++step) {
        // D is frozen for steps 2 and 3, A at step 5.
        for (Params* q : {&ref, &mine}) {
          (*q)[kD].requires_grad_(step < 2 || step > 3);
          (*q)[kA].requires_grad_(step != 5);
        }
        ref_opt->zero_grad(true);
        clear(step, oss, mine);
        for (int micro = 0; micro < 2; ++micro) {  // two backward passes accumulate
          auto data = testing::rank_data(2 * step + micro, g->rank(), 3);
          if (step == 0 && micro == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          testing::loss_of(testing::dominant_output(ref, data.x), data, 3).backward();
          testing::loss_of(testing::dominant_output(mine, data.x), data, 3).backward();
        }
        testing::allreduce_grads(ref, *g);
        testing::allreduce_grads(mine, *g);
        Params with_grad;
        for (auto& p : ref) {
          if (p.requires_grad()) with_grad.push_back(p);
        }
        // The total norm is torch's (an infinite max_norm measures without clipping); the
        // reference then clips by the norm OSS found, as clip_grad_norm_ does (max_norm / (norm +
        // 1e-6) where below 1). Two orders of summing squares differ in the last bit, and with
        // Adam's weight decay an element whose decayed gradient cancels to eps's size (1e-8) turns
        // that bit into 7e-6 of the parameter after one step (measured at world 3 on an AVX-512
        // machine), so the step's parity must not hinge on it.
        const double expected = torch::nn::utils::clip_grad_norm_(with_grad, std::numeric_limits<double>::infinity());
        const double norm = oss.clip_grad_norm(0.5);
        ASSERT_NEAR(norm, expected, 1e-6 * std::max(1.0, expected)) << "step " << step;
        if (0.5 / (norm + 1e-6) < 1.0) {
          at::NoGradGuard no_grad;
          for (auto& p : with_grad) p.mutable_grad().mul_(0.5 / (norm + 1e-6));
        }
        for (auto& p : ref) {
          if (!p.requires_grad()) p.mutable_grad().reset();  // a frozen parameter never moves
        }
        ref_opt->step();
        oss.step();
        ASSERT_TRUE(testing::matches_reference(mine, ref, *g, 1e-6)) << "after step " << step;
        if (step == 2 || step == 4) {
          // Freezing and unfreezing D cut the ranges again; the state of the ranges that changed
          // rank moved, and every byte sent was received.
          const auto& moved = oss.last_rebalance();
          EXPECT_GT(moved.params_moved, 0) << "step " << step;
          at::Tensor bytes = at::tensor({moved.state_bytes_sent, moved.state_bytes_received}, at::kLong);
          g->allreduce(bytes);
          EXPECT_GT(bytes[0].item<int64_t>(), 0) << "step " << step;
          EXPECT_EQ(bytes[0].item<int64_t>(), bytes[1].item<int64_t>()) << "step " << step;
        }
      }
    });
  }
};

TEST(Split, DominantTensorParityWithFreezingClippingClearingAndAccumulation) {
  const std::vector<std::pair<const char*, OptimizerFactory>> optimizers = {
      {"Adam", optimizer<optim::Adam>(optim::AdamOptions(1e-2).weight_decay(0.01).amsgrad(true))},
      {"AdamW", optimizer<optim::AdamW>(optim::AdamWOptions(1e-2))},
      {"SGD", optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9).nesterov(true))},
      {"Adagrad", optimizer<optim::Adagrad>(optim::AdagradOptions(0.05))},
  };
  for (int world : {2, 3, 4}) {
    for (const auto& [name, factory] : optimizers) {
      SCOPED_TRACE(std::string(name) + " world " + std::to_string(world));
      SplitParity p;
      p.world = world;
      p.factory = factory;
      p.run();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// Each rank holds 1/world of the optimizer state however large one tensor is.
TEST(Split, StateBytesAreOneWorldthAtAnyWorldSize) {
  Params init = testing::make_dominant_params();
  int64_t numel = 0;
  for (const auto& p : init) numel += p.numel();
  const int64_t total = 2 * 4 * numel;  // exp_avg + exp_avg_sq
  for (int world : {2, 3, 4, 8}) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      Params mine = testing::clone_params(init);
      OSS oss(mine, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
      for (auto& t : mine) t.mutable_grad() = at::ones_like(t);
      oss.step();
      const double ideal = static_cast<double>(total) / world;
      EXPECT_NEAR(static_cast<double>(oss.local_state_bytes()), ideal, 0.03 * ideal)
          << "rank " << g->rank() << " of " << world;
      EXPECT_LT(Introspection::imbalance(oss), 0.03);
      at::Tensor sum = at::full({1}, oss.local_state_bytes(), at::kLong);
      g->allreduce(sum);
      EXPECT_EQ(sum.item<int64_t>(), total);
    });
  }
}

// The consolidated state is PyTorch's whole-parameter layout, stitched from the ranges, equal to
// the state of an unsharded torch::optim::Adam; it loads on other world sizes and training goes on
// as if uninterrupted.
TEST(Split, ConsolidatedStateIsStitchedAndLoadsOnOtherWorldSizes) {
  auto adam = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  auto train = [](Params& p, optim::Optimizer& opt, OSS* oss, int from, int to, ProcessGroup* g) {
    for (int s = from; s < to; ++s) {
      opt.zero_grad(true);
      const int world = g ? g->size() : 1, rank = g ? g->rank() : 0;
      auto data = testing::global_data(s, rank * (12 / world), 12 / world);
      testing::loss_of(testing::dominant_output(p, data.x), data, 12).backward();
      if (g) testing::allreduce_grads(p, *g, /*average=*/false);
      if (oss) {
        oss->step();
      } else {
        opt.step();
      }
    }
  };
  Params ref = testing::make_dominant_params();
  optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
  train(ref, ref_opt, nullptr, 0, 3, nullptr);

  std::mutex mu;
  c10::IValue saved;
  Params handed_over;
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_dominant_params();
    OSS oss(p, adam, g);
    train(p, oss, &oss, 0, 3, g.get());
    oss.consolidate_state_dict(1);
    if (g->rank() != 1) return;
    const auto state = oss.state_dict().toGenericDict().at("state").toGenericDict();
    ASSERT_EQ(state.size(), p.size());
    for (size_t i = 0; i < p.size(); ++i) {
      const auto entry = state.at(static_cast<int64_t>(i)).toGenericDict();
      const auto& expected = static_cast<const optim::AdamParamState&>(*ref_opt.state().at(ref[i].unsafeGetTensorImpl()));
      EXPECT_LE(testing::rel_diff(entry.at("exp_avg").toTensor(), expected.exp_avg()), 1e-5) << "parameter " << i;
      EXPECT_LE(testing::rel_diff(entry.at("exp_avg_sq").toTensor(), expected.exp_avg_sq()), 1e-5) << "parameter " << i;
      EXPECT_EQ(entry.at("step").toTensor().item<double>(), 3.0);
    }
    std::lock_guard<std::mutex> lock(mu);
    saved = oss.state_dict();
    handed_over = testing::clone_params(p);
  });
  ASSERT_FALSE(handed_over.empty());
  train(ref, ref_opt, nullptr, 3, 6, nullptr);
  for (int world : {2, 4}) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      Params p = testing::clone_params(handed_over);
      OSS oss(p, adam, g);
      oss.load_state_dict(saved);
      train(p, oss, &oss, 3, 6, g.get());
      for (size_t i = 0; i < p.size(); ++i) {
        EXPECT_LE(testing::rel_diff(p[i], ref[i]), 1e-5) << "parameter " << i << " at world " << world;
      }
    });
  }
}

// A user's own optimizer, unknown to shardopt: p -= lr * sign(grad).
struct SignSGDOptions : public optim::OptimizerCloneableOptions<SignSGDOptions> {
  SignSGDOptions(double lr = 0.01) : lr_(lr) {}
  TORCH_ARG(double, lr);
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

class SignSGD : public optim::Optimizer {
 public:
  SignSGD(std::vector<optim::OptimizerParamGroup> groups, SignSGDOptions defaults)
      : Optimizer(std::move(groups), std::make_unique<SignSGDOptions>(defaults)) {}
  at::Tensor step(LossClosure closure = nullptr) override {
    at::NoGradGuard no_grad;
    for (auto& group : param_groups_) {
      const double lr = static_cast<SignSGDOptions&>(group.options()).lr();
      for (auto& p : group.params()) {
        if (p.grad().defined()) p.add_(p.grad().sign(), -lr);
      }
    }
    return {};
  }
};

template <class F>
void expect_error(F&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing: " << needle;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

// A user's optimizer keeps whole parameters and steps like the unsharded one; what needs its state
// moved or encoded fails by name, at construction or first use, never silently.
TEST(Split, OptimizersThatAreNotElementWiseKeepWholeParametersOrAreRefused) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    const auto sign = optimizer<SignSGD>(SignSGDOptions(0.01));
    Params p = testing::make_dominant_params();
    // (The class's full name holds this file's namespace: tests/CMakeLists.txt.)
    expect_error([&] { OSS oss(p, sign, g); }, "::SignSGD is not registered");
    Params ref = testing::clone_params(p);
    SignSGD ref_opt({optim::OptimizerParamGroup(ref)}, SignSGDOptions(0.01));
    OSS oss(p, sign, g, OSSOptions().rebalance(false));
    EXPECT_FALSE(Introspection::split(oss));
    EXPECT_NE(oss.describe().find("whole parameters"), std::string::npos) << oss.describe();
    for (const auto& t : p) EXPECT_GE(oss.owner(t), 0);
    for (int step = 0; step < 3; ++step) {
      oss.zero_grad();
      ref_opt.zero_grad();
      auto data = testing::rank_data(step, g->rank(), 3);
      testing::loss_of(testing::dominant_output(p, data.x), data, 3).backward();
      testing::loss_of(testing::dominant_output(ref, data.x), data, 3).backward();
      testing::allreduce_grads(p, *g);
      testing::allreduce_grads(ref, *g);
      oss.step();
      ref_opt.step();
    }
    for (size_t i = 0; i < p.size(); ++i) EXPECT_LE(testing::rel_diff(p[i], ref[i]), 1e-6) << "parameter " << i;
    expect_error([&] { oss.consolidate_state_dict(0); }, "::SignSGD, which is not registered");

    Params q = testing::make_dominant_params();
    expect_error([&] { OSS lbfgs(q, optimizer<optim::LBFGS>(optim::LBFGSOptions(0.1)), g); }, "OSS cannot shard LBFGS");
    OSS forced(q, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g,
               OSSOptions().partition(PartitionMode::kWholeParameters));
    EXPECT_FALSE(Introspection::split(forced));
    EXPECT_GT(Introspection::imbalance(forced), 0.8) << "one rank holds the dominant tensor";
    expect_error([&] { OSS split(q, sign, g, OSSOptions().rebalance(false).partition(PartitionMode::kSplit)); },
                 "partition kSplit needs optimizers shardopt can move state for");
  });
}

// kAuto splits element-wise optimizers' parameters into row buckets. With a threshold it keeps
// whole parameters where they balance within it: equal tensors stay whole (and each rank still
// holds its share), a dominant tensor is split.
TEST(Split, AutoSplitsUnlessWholeParametersBalanceWithinTheThreshold) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    Params equal;
    for (int i = 0; i < 8; ++i) equal.push_back(at::zeros({50}).requires_grad_());
    // By default element-wise optimizers always split (row buckets); a threshold keeps whole
    // parameters that balance within it.
    OSS by_default(testing::clone_params(equal), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    EXPECT_TRUE(Introspection::split(by_default));
    OSS balanced(equal, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g, OSSOptions().split_above_imbalance(0.03));
    EXPECT_FALSE(Introspection::split(balanced));
    EXPECT_NE(balanced.describe().find("whole parameters balance within 0%, under the 3%"), std::string::npos)
        << balanced.describe();
    EXPECT_DOUBLE_EQ(Introspection::imbalance(balanced), 0.0);
    Params dominant = testing::make_dominant_params();
    OSS lopsided(dominant, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g, OSSOptions().split_above_imbalance(0.03));
    EXPECT_TRUE(Introspection::split(lopsided));
    Params again = testing::make_dominant_params();
    OSS never(again, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g, OSSOptions().split_above_imbalance(100.0));
    EXPECT_FALSE(Introspection::split(never));
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
