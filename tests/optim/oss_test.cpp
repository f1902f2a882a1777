#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <set>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;
using GroupsFn = std::function<std::vector<optim::OptimizerParamGroup>(const Params&)>;

std::vector<optim::OptimizerParamGroup> one_group(const Params& p) {
  return {optim::OptimizerParamGroup(p)};
}

// Runs `steps` of OSS and of the all-reduce reference on `world` ranks and checks, after every
// step: OSS parameters equal the reference's (1e-6 relative), and are bitwise equal across ranks.
struct Parity {
  int world = 2;
  int steps = 10;
  int per_rank = 4;
  OptimizerFactory factory;
  GroupsFn groups = one_group;
  Params (*params)() = [] { return testing::make_params(); };
  // Called before each step's backward on both models (freeze, unfreeze, ...).
  std::function<void(int step, Params& ref, Params& mine)> before_backward;
  // How the OSS side clears its gradients before backward (default: zero_grad(true)).
  std::function<void(OSS& oss, Params& mine)> clear;
  std::optional<double> clip_norm_type;
  bool with_scheduler = false;
  // Called after each step (and its checks) with this rank's optimizer.
  std::function<void(int step, OSS& oss, ProcessGroup& group)> after_step;
  // Called right before each OSS step.
  std::function<void(int step, OSS& oss)> before_step;
  OSSOptions options;

  void run() const {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      Params init = params();
      Params ref = testing::clone_params(init), mine = testing::clone_params(init);
      auto ref_opt = factory(groups(ref));
      OSS oss(groups(mine), factory, g, options);
      std::unique_ptr<optim::StepLR> ref_sched, oss_sched;
      if (with_scheduler) {
        ref_sched = std::make_unique<optim::StepLR>(*ref_opt, 3, 0.5);
        oss_sched = std::make_unique<optim::StepLR>(oss, 3, 0.5);
      }
      std::vector<at::Tensor> frozen_before(mine.size());
      for (int step = 0; step < steps; ++step) {
        auto data = testing::rank_data(step, g->rank(), per_rank);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << "each rank's data must differ";
        ref_opt->zero_grad(true);
        if (clear) {
          clear(oss, mine);
        } else {
          oss.zero_grad(true);
        }
        if (before_backward) before_backward(step, ref, mine);
        for (size_t i = 0; i < mine.size(); ++i) frozen_before[i] = mine[i].requires_grad() ? at::Tensor() : mine[i].detach().clone();

        testing::loss(ref, data, per_rank).backward();
        testing::loss(mine, data, per_rank).backward();
        testing::allreduce_grads(ref, *g);
        testing::allreduce_grads(mine, *g);
        if (clip_norm_type) {
          Params with_grad;
          for (auto& p : ref) if (p.grad().defined() && p.requires_grad()) with_grad.push_back(p);
          double expected = torch::nn::utils::clip_grad_norm_(with_grad, 0.5, *clip_norm_type);
          double got = oss.clip_grad_norm(0.5, *clip_norm_type);
          ASSERT_NEAR(got, expected, 1e-6 * std::max(1.0, expected)) << "step " << step;
        }
        ref_opt->step();
        if (before_step) before_step(step, oss);
        oss.step();
        if (ref_sched) ref_sched->step(), oss_sched->step();

        for (size_t i = 0; i < mine.size(); ++i) {
          ASSERT_LE(testing::rel_diff(mine[i], ref[i]), 1e-6) << "parameter " << i << " after step " << step;
          if (frozen_before[i].defined()) {
            ASSERT_TRUE(mine[i].detach().equal(frozen_before[i])) << "frozen parameter " << i << " moved at step " << step;
          }
        }
        ASSERT_TRUE(testing::same_on_all_ranks(mine, *g)) << "ranks diverged after step " << step;
        if (after_step) after_step(step, oss, *g);
      }
    });
  }
};

struct NamedFactory {
  const char* name;
  OptimizerFactory factory;
};

std::vector<NamedFactory> all_optimizers() {
  return {
      {"Adam", optimizer<optim::Adam>(optim::AdamOptions(1e-2))},
      {"AdamW", optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.1))},
      {"SGD-momentum", optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9).nesterov(true))},
      {"RMSprop", optimizer<optim::RMSprop>(optim::RMSpropOptions(1e-2).momentum(0.5).centered(true))},
      {"Adagrad", optimizer<optim::Adagrad>(optim::AdagradOptions(0.1).lr_decay(0.01))},
  };
}

class OSSParity : public ::testing::TestWithParam<int> {};

TEST_P(OSSParity, MatchesAllReduceReferenceForEveryOptimizer) {
  for (const auto& opt : all_optimizers()) {
    SCOPED_TRACE(opt.name);
    Parity p;
    p.world = GetParam();
    p.factory = opt.factory;
    p.run();
  }
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, OSSParity, ::testing::Values(1, 2, 3, 4));

TEST(OSS, ParamGroupsWithDifferentOptionsAndScheduler) {
  Parity p;
  p.world = 3;
  p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  p.groups = [](const Params& q) {
    return std::vector<optim::OptimizerParamGroup>{
        optim::OptimizerParamGroup({q[0], q[1]}),
        optim::OptimizerParamGroup({q[2], q[3], q[4]},
                                   std::make_unique<optim::AdamOptions>(optim::AdamOptions(3e-2).weight_decay(0.1)))};
  };
  p.with_scheduler = true;
  p.run();
}

TEST(OSS, MoreRanksThanParameters) {
  Parity p;
  p.world = 4;
  p.params = [] {
    Params q = testing::make_params();
    return Params{q[0], q[1], q[2]};
  };
  // A model of three tensors: fold the missing ones into constants.
  p.groups = one_group;
  p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  p.before_backward = nullptr;
  // The loss needs five tensors: build it from three parameters and two constants.
  Params (*full)(const Params&) = nullptr;
  (void)full;
  run_ranks(4, [&](std::shared_ptr<ProcessGroup> g) {
    Params init = p.params();
    Params ref = testing::clone_params(init), mine = testing::clone_params(init);
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(mine, p.factory, g);
    int owned = static_cast<int>(Introspection::partition(oss).shard(g->rank()).size());
    at::Tensor counts = at::full({1}, owned, at::kLong);
    g->allreduce(counts);
    ASSERT_EQ(counts.item<int64_t>(), 3);
    at::Tensor empty = at::full({1}, owned == 0 ? 1 : 0, at::kLong);
    g->allreduce(empty);
    ASSERT_GE(empty.item<int64_t>(), 1) << "some rank must own nothing";
    const at::Tensor b2 = at::zeros({3}), s = at::ones({3});
    for (int step = 0; step < 5; ++step) {
      auto data = testing::rank_data(step, g->rank(), 4);
      for (Params* q : {&ref, &mine}) {
        testing::loss({(*q)[0], (*q)[1], (*q)[2], b2, s}, data, 4).backward();
        testing::allreduce_grads(*q, *g);
      }
      ref_opt.step();
      oss.step();
      ref_opt.zero_grad(true);
      oss.zero_grad(true);
      for (size_t i = 0; i < mine.size(); ++i) ASSERT_LE(testing::rel_diff(mine[i], ref[i]), 1e-6);
      ASSERT_TRUE(testing::same_on_all_ranks(mine, *g));
    }
  });
}

TEST(OSS, FrozenParameterFromTheStart) {
  Parity p;
  p.world = 2;
  p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  p.params = [] {
    Params q = testing::make_params();
    q[2].requires_grad_(false);
    return q;
  };
  p.run();
}

// With the step's own check off, refresh_trainable() is where the ranks agree on the trainable
// set: a parameter unfrozen and refreshed by hand is stepped from that step on, as torch::optim
// steps it, whole and split.
TEST(OSS, AnUnfreezeRefreshedByHandIsSteppedWithTheStepsCheckOff) {
  for (PartitionMode mode : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
    SCOPED_TRACE(mode == PartitionMode::kSplit ? "split" : "whole");
    Parity p;
    p.world = 2;
    p.steps = 5;
    p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
    p.options = OSSOptions().check_trainable_every_step(false).partition(mode);
    p.params = [] {
      Params q = testing::make_params();
      q[2].requires_grad_(false);
      return q;
    };
    p.before_backward = [](int step, Params& ref, Params& mine) {
      if (step == 2) ref[2].requires_grad_(true), mine[2].requires_grad_(true);
    };
    p.before_step = [](int step, OSS& oss) {
      if (step == 2) oss.refresh_trainable();
    };
    p.run();
  }
}

TEST(OSS, FreezeAndUnfreezeBetweenSteps) {
  for (const auto& opt : all_optimizers()) {
    SCOPED_TRACE(opt.name);
    Parity p;
    p.world = 3;
    p.factory = opt.factory;
    p.before_backward = [](int step, Params& ref, Params& mine) {
      const bool frozen_w1 = step >= 2 && step < 5, frozen_s = step >= 4 && step < 8;
      for (Params* q : {&ref, &mine}) {
        (*q)[0].requires_grad_(!frozen_w1);
        (*q)[4].requires_grad_(!frozen_s);
      }
    };
    // Stale zero gradients stay on frozen parameters: they still must not move.
    p.clear = [](OSS& oss, Params&) { oss.zero_grad(false); };
    p.run();
  }
}

// The step reads the users' gradients and writes none of them: every parameter's .grad is the
// same tensor with the same values after step() (a frozen one with a stale gradient included),
// on the fused path (AdamW) and the wrapped optimizer's own step (RMSprop), whole and split. The
// frozen parameter does not move, and the rest equal torch::optim stepping without it.
TEST(OSS, TheStepLeavesEveryGradientAsItWas) {
  for (const auto& opt : {all_optimizers()[1], all_optimizers()[3]}) {
    for (auto mode : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
      run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
        const std::string where = std::string(opt.name) + (mode == PartitionMode::kSplit ? ", split" : ", whole") +
                                  ", rank " + std::to_string(g->rank());
        Params ref = testing::make_params(), mine = testing::clone_params(ref);
        auto ref_opt = opt.factory({optim::OptimizerParamGroup(ref)});
        OSS oss(mine, opt.factory, g, OSSOptions().partition(mode));
        for (int step = 0; step < 4; ++step) {
          auto data = testing::rank_data(step, g->rank(), 4);
          ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << where;
          ref_opt->zero_grad(true);
          oss.zero_grad(true);
          for (Params* q : {&ref, &mine}) {
            for (auto& p : *q) p.requires_grad_(true);
          }
          testing::loss(ref, data, 4).backward();
          testing::loss(mine, data, 4).backward();
          testing::allreduce_grads(ref, *g);
          testing::allreduce_grads(mine, *g);
          // Frozen after backward: it keeps a gradient it must not be stepped with.
          const size_t frozen = step % 2 == 0 ? 0 : 3;
          ref[frozen].requires_grad_(false);
          mine[frozen].requires_grad_(false);
          ref[frozen].mutable_grad().reset();
          std::vector<at::Tensor> grads, values;
          for (auto& p : mine) {
            ASSERT_TRUE(p.grad().defined()) << where;
            grads.push_back(p.grad());
            values.push_back(p.grad().clone());
          }
          const at::Tensor frozen_before = mine[frozen].detach().clone();
          ref_opt->step();
          oss.step();
          for (size_t i = 0; i < mine.size(); ++i) {
            ASSERT_TRUE(mine[i].grad().is_same(grads[i])) << where << ": step " << step << " replaced the gradient of "
                                                          << "parameter " << i;
            ASSERT_TRUE(mine[i].grad().equal(values[i])) << where << ": step " << step << " changed the gradient of "
                                                         << "parameter " << i;
            ASSERT_LE(testing::rel_diff(mine[i], ref[i]), 1e-6) << where << ": parameter " << i << ", step " << step;
          }
          ASSERT_TRUE(mine[frozen].detach().equal(frozen_before)) << where << ": the frozen parameter moved";
        }
      });
    }
  }
}

// The trainable work each rank steps under the optimizer's partition (max / mean - 1), and the
// best any whole-tensor partition achieves for the current trainable set.
double trainable_imbalance(const OSS& oss, bool best = false) {
  std::vector<int64_t> weights;
  for (const auto& p : Introspection::all_params(oss)) weights.push_back(p.numel() * static_cast<int64_t>(p.element_size()));
  std::vector<uint8_t> mask;
  for (const auto& p : Introspection::all_params(oss)) mask.push_back(p.requires_grad());
  if (best) return Partition::balance(weights, Introspection::partition(oss).world_size(), mask).imbalance();
  return Introspection::partition(oss).imbalance(weights, mask);
}

// Freezing w1 and w2 (82% of the model) leaves all trainable work on one rank; the step after
// the freeze re-partitions and moves optimizer state, unfreezing does it again where needed, and training
// stays equal to the reference throughout (so the moved state, the frozen tensors' included, is
// exact).
TEST(OSS, FreezingRebalancesTheWorkAndMovesTheState) {
  for (int world : {2, 3}) {
    for (const auto& opt : all_optimizers()) {
      SCOPED_TRACE(std::string(opt.name) + " world " + std::to_string(world));
      Parity p;
      p.world = world;
      p.steps = 9;
      p.factory = opt.factory;
      p.options.partition(PartitionMode::kWholeParameters);  // re-partitioning moves whole parameters
      p.before_backward = [](int step, Params& ref, Params& mine) {
        for (Params* q : {&ref, &mine}) {
          for (int i : {0, 2}) (*q)[i].requires_grad_(!(step >= 2 && step < 6));
        }
      };
      p.after_step = [](int step, OSS& oss, ProcessGroup& g) {
        if (step == 1) {
          ASSERT_EQ(Introspection::partition_version(oss), 0);
        }
        if (step == 2) {
          ASSERT_EQ(Introspection::partition_version(oss), 1) << "the freeze must re-partition";
          const auto& st = oss.last_rebalance();
          EXPECT_GT(st.imbalance_before, 0.5);
          EXPECT_LT(st.imbalance_after, st.imbalance_before);
          EXPECT_NEAR(trainable_imbalance(oss), st.imbalance_after, 1e-12);
          EXPECT_GT(st.params_moved, 0);
          at::Tensor moved = at::tensor({st.state_bytes_sent, st.state_bytes_received}, at::kLong);
          g.allreduce(moved);
          EXPECT_GT(moved[0].item<int64_t>(), 0) << "optimizer state must move with its parameters";
          EXPECT_EQ(moved[0].item<int64_t>(), moved[1].item<int64_t>()) << "every byte sent is received";
        }
        // Unfreezing re-partitions again unless the frozen tensors' kept state was spread so that
        // the work is as balanced as whole tensors allow already (Note [Kept state]); either way
        // the next line holds.
        if (step == 6) EXPECT_GE(Introspection::partition_version(oss), 1);
        if (step >= 2) EXPECT_NEAR(trainable_imbalance(oss), trainable_imbalance(oss, true), 1e-12) << "step " << step;
      };
      p.run();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(OSS, RebalanceOffKeepsThePartition) {
  Parity p;
  p.steps = 4;
  p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  p.options.rebalance(false);
  p.before_backward = [](int step, Params& ref, Params& mine) {
    for (Params* q : {&ref, &mine}) (*q)[0].requires_grad_(step < 2);
  };
  p.after_step = [](int step, OSS& oss, ProcessGroup&) {
    EXPECT_EQ(Introspection::partition_version(oss), 0);
    if (step >= 2) EXPECT_GT(trainable_imbalance(oss), 0.5) << "frozen w1's rank has nothing to step";
  };
  p.run();
}

TEST(OSS, EveryWayOfClearingGradientsKeepsParity) {
  std::vector<std::pair<const char*, std::function<void(OSS&, Params&)>>> ways = {
      {"zero_grad(true)", [](OSS& o, Params&) { o.zero_grad(true); }},
      {"zero_grad(false)", [](OSS& o, Params&) { o.zero_grad(false); }},
      {"Optimizer::zero_grad()", [](OSS& o, Params&) { static_cast<optim::Optimizer&>(o).zero_grad(); }},
      {"Optimizer::zero_grad(false)", [](OSS& o, Params&) { static_cast<optim::Optimizer&>(o).zero_grad(false); }},
      {"reset mutable_grad", [](OSS&, Params& q) { for (auto& t : q) t.mutable_grad().reset(); }},
      {"grad().zero_()", [](OSS&, Params& q) { for (auto& t : q) if (t.grad().defined()) t.grad().zero_(); }},
  };
  for (auto& [name, way] : ways) {
    SCOPED_TRACE(name);
    Parity p;
    p.world = 2;
    p.steps = 4;
    p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
    p.clear = way;
    p.run();
  }
}

TEST(OSS, ClipGradNormEqualsFullGradientClipping) {
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    SCOPED_TRACE(norm_type);
    Parity p;
    p.world = 3;
    p.steps = 5;
    p.factory = optimizer<optim::SGD>(optim::SGDOptions(0.1).momentum(0.9));
    p.clip_norm_type = norm_type;
    p.run();
  }
}

TEST(OSS, ClipRightAfterUnfreezeCountsTheUnfrozenParameter) {
  Parity p;
  p.world = 2;
  p.steps = 5;
  p.factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  p.clip_norm_type = 2.0;
  // Parameter 0 is frozen during steps 1 and 2 and unfrozen before step 3's backward, after the
  // last step() saw it frozen.
  p.before_backward = [](int step, Params& ref, Params& mine) {
    const bool frozen = step == 1 || step == 2;
    ref[0].requires_grad_(!frozen);
    mine[0].requires_grad_(!frozen);
  };
  p.run();
}

// A NaN in one rank's gradient makes the global norm non-finite: with error_if_nonfinite every
// rank refuses, naming the norm, as torch::nn::utils::clip_grad_norm_ refuses the full gradient,
// and no gradient is scaled; without it, both clip to NaN alike.
TEST(OSS, ClipGradNormErrorIfNonfiniteRefusesOnEveryRank) {
  const auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    Params q;
    for (int i = 0; i < 4; ++i) q.push_back(at::zeros({50 + i}).requires_grad_());
    OSS oss(q, optimizer<optim::SGD>(optim::SGDOptions(0.1)), g);
    for (size_t i = 0; i < q.size(); ++i) q[i].mutable_grad() = at::full_like(q[i], 3.0);
    if (g->rank() == 1) {
      for (auto& t : q) t.mutable_grad()[0] = std::nan("");  // every tensor: whichever rank owns it sees one
    }
    Params full;  // the reference: the full gradient on one process, with the NaN
    for (const auto& t : q) full.push_back(at::zeros_like(t).requires_grad_());
    for (size_t i = 0; i < q.size(); ++i) {
      full[i].mutable_grad() = at::full_like(q[i], 3.0);
      full[i].mutable_grad()[0] = std::nan("");
    }
    EXPECT_THROW(torch::nn::utils::clip_grad_norm_(full, 1.0, 2.0, /*error_if_nonfinite=*/true), c10::Error);
    try {
      oss.clip_grad_norm(1.0, 2.0, /*error_if_nonfinite=*/true);
    } catch (const c10::Error&) {
      for (const auto& t : q) {  // no gradient scaled (the finite elements still hold 3)
        const int64_t n = t.numel() - 1;
        EXPECT_TRUE(t.grad().narrow(0, 1, n).equal(at::full({n}, 3.0))) << "rank " << g->rank();
      }
      throw;
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("clip_grad_norm: the total norm of order 2 of the gradients is non-finite (nan)"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
}

// layout()'s reference stays the same layout while the trainable set does not change, and a
// step after a freeze makes a new one; a copy taken before keeps the old pieces.
TEST(OSS, TheLayoutsReferenceLastsUntilTheNextLayoutAndACopyLongerStill) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    Params q;
    for (int i = 0; i < 4; ++i) q.push_back(at::zeros({50 + i}).requires_grad_());
    OSS oss(q, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    auto step = [&] {
      for (auto& t : q) t.mutable_grad() = t.requires_grad() ? at::ones_like(t) : at::Tensor();
      oss.step();
    };
    step();
    const FlatLayout* first = &oss.layout();
    const FlatLayout copy = oss.layout();
    const size_t pieces = copy.pieces().size();
    auto trainable = [](const FlatLayout& l) {
      std::set<size_t> params;
      for (const auto& piece : l.pieces()) if (piece.owner >= 0) params.insert(piece.param);
      return params;
    };
    ASSERT_EQ(trainable(copy), (std::set<size_t>{0, 1, 2, 3}));
    step();
    step();
    EXPECT_EQ(&oss.layout(), first) << "the same trainable set keeps the layout";
    q[0].requires_grad_(false);
    step();
    EXPECT_NE(&oss.layout(), first) << "a freeze makes a new layout";
    EXPECT_EQ(trainable(oss.layout()), (std::set<size_t>{1, 2, 3}));
    EXPECT_EQ(copy.pieces().size(), pieces);
    EXPECT_EQ(trainable(copy), (std::set<size_t>{0, 1, 2, 3})) << "the copy keeps the old layout";
  });
}

TEST(OSS, StateBytesAreSharded) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    Params q;
    for (int i = 0; i < 8; ++i) q.push_back(at::zeros({100 + i}).requires_grad_());
    OSS oss(q, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    for (auto& t : q) t.mutable_grad() = at::ones_like(t);
    oss.step();
    int64_t total = 0;
    for (auto& t : q) total += 2 * t.numel() * 4;  // exp_avg + exp_avg_sq
    at::Tensor mine = at::full({1}, oss.local_state_bytes(), at::kLong);
    at::Tensor sum = mine.clone();
    g->allreduce(sum);
    EXPECT_EQ(sum.item<int64_t>(), total);
    EXPECT_NEAR(static_cast<double>(mine.item<int64_t>()), total / 2.0, total * 0.03);
    // describe() has each rank's line: its state bytes, as that rank counts them, and the
    // parameters it holds whole and in part (a parameter split over both counts on both).
    const auto bytes = g->allgather_ints({oss.local_state_bytes()});
    const std::string text = oss.describe();
    int64_t held = 0;
    for (int r = 0; r < 2; ++r) {
      const std::string head = "rank " + std::to_string(r) + ": state ";
      const size_t at = text.find(head);
      ASSERT_NE(at, std::string::npos) << text;
      long long state = -1, whole = -1, split = -1;
      ASSERT_EQ(std::sscanf(text.c_str() + at + head.size(), "%lld bytes, %lld whole and %lld split", &state, &whole,
                            &split),
                3)
          << text;
      EXPECT_EQ(state, bytes[r][0]) << "rank " << r << "\n" << text;
      EXPECT_GE(whole + split, 1) << "rank " << r << "\n" << text;
      held += whole + split;
    }
    EXPECT_GE(held, static_cast<int64_t>(q.size())) << text;
  });
}

// owner() and owners() (public: the API contract's "rank that owns its state"): with whole
// parameters each parameter has one owner, and the state bytes a rank holds are those of the
// parameters it owns; in row buckets a parameter cut across the ranks answers -1 and owners()
// lists both.
TEST(OSS, OwnerAndOwnersNameTheRanksThatHoldTheState) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    Params q;
    for (int i = 0; i < 6; ++i) q.push_back(at::zeros({100 + i}).requires_grad_());
    OSS whole(q, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g,
              OSSOptions().partition(PartitionMode::kWholeParameters));
    for (auto& t : q) t.mutable_grad() = at::ones_like(t);
    whole.step();
    int64_t mine = 0;
    std::set<int> seen;
    for (auto& t : q) {
      const int owner = whole.owner(t);
      ASSERT_TRUE(owner == 0 || owner == 1) << owner;
      EXPECT_EQ(whole.owners(t), std::vector<int>{owner});
      seen.insert(owner);
      if (owner == g->rank()) mine += 2 * t.numel() * 4;  // exp_avg + exp_avg_sq
    }
    EXPECT_EQ(seen.size(), 2u) << "both ranks own parameters";
    EXPECT_EQ(whole.local_state_bytes(), mine);
    EXPECT_THROW(
        {
          try {
            whole.owner(at::zeros({3}));
          } catch (const c10::Error& e) {
            EXPECT_THAT(e.what_without_backtrace(), ::testing::HasSubstr("is not a parameter of this OSS"));
            throw;
          }
        },
        c10::Error);

    Params r{at::zeros({4000}).requires_grad_(), at::zeros({10}).requires_grad_(), at::zeros({7}).requires_grad_()};
    r[2].requires_grad_(false);
    OSS split(r, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    r[0].mutable_grad() = at::ones_like(r[0]);
    r[1].mutable_grad() = at::ones_like(r[1]);
    split.step();
    EXPECT_EQ(split.owner(r[0]), -1);
    EXPECT_EQ(split.owners(r[0]), (std::vector<int>{0, 1}));
    ASSERT_EQ(split.owners(r[1]).size(), 1u);
    EXPECT_EQ(split.owner(r[1]), split.owners(r[1])[0]);
    // A frozen parameter has an owner too: the rank that keeps its state (or will, once stepped).
    ASSERT_EQ(split.owners(r[2]).size(), 1u);
    EXPECT_EQ(split.owner(r[2]), split.owners(r[2])[0]);
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
