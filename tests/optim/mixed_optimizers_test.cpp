// Several optimizers in one OSS (Muon on the hidden matrices, AdamW on the rest) under ShardedDDP,
// against a single-process reference built on the same optimizers: parity through freezing and
// unfreezing a hidden matrix and an embedding, with clipping, at world sizes 2, 3 and 4; the
// owners of whole matrices balanced by Newton-Schulz cost, not bytes; and both on int8 wires.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>
#include <shardopt/optim/partition.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "optim/master_recipe.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/functional.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/embedding.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/schedulers/step_lr.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::Introspection;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// tokens [B, 5] -> embedding [B, 5, 8] -> mean [B, 8] -> tanh(Linear 8x16) -> tanh(Linear 16x16)
// -> Linear 16x3. Parameters: 0 embedding, 1-2 first linear, 3-4 hidden linear, 5-6 head.
torch::nn::Sequential token_net(uint64_t seed) {
  auto made = torch::nn::Sequential(
      torch::nn::Embedding(20, 8), torch::nn::Functional([](const at::Tensor& t) { return t.mean(1); }),
      torch::nn::Linear(8, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16), torch::nn::Tanh(),
      torch::nn::Linear(16, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

at::Tensor tokens(const at::Tensor& x) {
  return (x.abs() * 7).to(at::kLong).remainder(20);
}

// Muon on the two hidden matrices (parameters 1 and 3), AdamW on everything else.
const std::vector<size_t> kMatrices{1, 3};
const std::vector<size_t> kOthers{0, 2, 4, 5, 6};

Params pick(const Params& all, const std::vector<size_t>& which) {
  Params out;
  for (size_t i : which) out.push_back(all[i]);
  return out;
}

MuonOptions muon_options() { return MuonOptions(0.02).weight_decay(0.01); }
optim::AdamWOptions adamw_options() { return optim::AdamWOptions(3e-3).weight_decay(0.01); }

// Muon on token_net's hidden matrices, AdamW on the rest.
OSS muon_and_adamw(const Params& params, std::shared_ptr<ProcessGroup> g, OSSOptions options = {}) {
  return OSS({{pick(params, kMatrices), optimizer<Muon>(muon_options())},
              {pick(params, kOthers), optimizer<optim::AdamW>(adamw_options())}},
             std::move(g), options);
}

// kAuto splits AdamW's parameters; kWholeParameters keeps every parameter whole, the matrices
// weighed by cost and the rest by bytes in one partition (at world 2 only).
//
// Two tolerances. AdamW's parameters are fp32 through and through: they must match the reference
// as closely as the single-optimizer AdamW parity tests (oss_test.cpp) do, 1e-6. Only Muon's
// matrices get 1e-3 (their update is bfloat16, below). The AdamW options decay by lr *
// weight_decay = 3e-5 of each parameter per step, 30 times that tolerance at the first step
// already, so an OSS that dropped (or doubled) AdamW's weight decay fails here.
TEST(MixedOptimizers, MuonAndAdamWMatchASingleProcessReferenceThroughFreezes) {
  constexpr double kAdamWTolerance = 1e-6;  // fp32 AdamW, as oss_test.cpp's parity
  constexpr double kMuonTolerance = 1e-3;   // bfloat16 Newton-Schulz
  ASSERT_GT(adamw_options().weight_decay(), 0.0);
  ASSERT_GE(adamw_options().lr() * adamw_options().weight_decay(), 10 * kAdamWTolerance)
      << "AdamW's weight decay must move its parameters by far more than the tolerance in one step";
  for (const auto& [world, mode] : std::vector<std::pair<int, PartitionMode>>{
           {2, PartitionMode::kAuto}, {3, PartitionMode::kAuto}, {4, PartitionMode::kAuto},
           {2, PartitionMode::kWholeParameters}}) {
    run_ranks(world, [&, world = world, mode = mode](std::shared_ptr<ProcessGroup> g) {
      const std::string where = "world " + std::to_string(world) + (mode == PartitionMode::kAuto ? ", kAuto" : ", kWhole") +
                                ", rank " + std::to_string(g->rank());
      auto net = token_net(5), ref_net = token_net(5);
      Params params = net->parameters(), ref = ref_net->parameters();
      OSS oss = muon_and_adamw(params, g, OSSOptions().partition(mode));
      ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().reduce_bucket_bytes(512));
      Muon ref_muon(pick(ref, kMatrices), muon_options());
      optim::AdamW ref_adamw(pick(ref, kOthers), adamw_options());
      ASSERT_EQ(Introspection::num_optimizers(oss), 2u);
      ASSERT_EQ(Introspection::split(oss), mode == PartitionMode::kAuto) << oss.describe();
      for (int step = 0; step < 9; ++step) {
        // The hidden matrix (Muon) and the embedding (AdamW) frozen for steps 3-5.
        const bool frozen = step >= 3 && step < 6;
        for (Params* q : {&params, &ref}) (*q)[3].requires_grad_(!frozen), (*q)[0].requires_grad_(!frozen);
        const auto data = testing::rank_data(step, g->rank(), 4);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << where;
        ddp.zero_grad();
        testing::loss_of(ddp.forward(tokens(data.x)), data, 4).backward();
        const double norm = oss.clip_grad_norm(0.5);
        oss.step();

        ref_muon.zero_grad(true);
        ref_adamw.zero_grad(true);
        testing::loss_of(ref_net->forward(tokens(data.x)), data, 4).backward();
        testing::allreduce_grads(ref, *g);
        const double ref_norm = torch::nn::utils::clip_grad_norm_(ref, 0.5);
        ref_muon.step();
        ref_adamw.step();
        EXPECT_NEAR(norm, ref_norm, 1e-5 * ref_norm) << where << ", step " << step;
        // AdamW's parameters (token_net's 0, 2, 4, 5, 6; numbered 0-4 in a mismatch) to fp32
        // parity. Every rank makes both checks (each is collective).
        ASSERT_TRUE(testing::matches_reference(pick(params, kOthers), pick(ref, kOthers), *g, kAdamWTolerance))
            << where << ", step " << step << ", AdamW's parameters";
        // Muon's update is bfloat16 (Note [Muon's step]): a gradient a rounding apart can flip the
        // last bit of a bfloat16 element, 2^-8 of it, times the learning rate.
        ASSERT_TRUE(testing::matches_reference(pick(params, kMatrices), pick(ref, kMatrices), *g, kMuonTolerance))
            << where << ", step " << step << ", Muon's matrices";
        // The matrices stay whole on one owner; the rest is cut into equal ranges.
        for (size_t i : kMatrices) {
          EXPECT_TRUE(Introspection::kept_whole(oss, Introspection::index_of(oss, params[i]))) << where;
          EXPECT_EQ(oss.owners(params[i]).size(), 1u) << where << ", parameter " << i;
        }
        EXPECT_EQ(Introspection::kept_whole(oss, Introspection::index_of(oss, params[6])), mode == PartitionMode::kWholeParameters) << where;
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// Matrices of very different shapes: 8 flat ones (16 x 1024) and 8 square ones (128 x 128) have
// the same bytes, but a square one's Newton-Schulz iteration costs 128^2 (2*128 + 128) = 6.3e6
// multiply-adds against 16^2 (2*1024 + 16) = 5.3e5. Balanced by cost, every rank gets two square
// ones; balanced by bytes, a rank can get four square ones and none of the cheap.
TEST(MixedOptimizers, WholeMatricesAreBalancedByNewtonSchulzCost) {
  std::vector<std::vector<int64_t>> shapes;
  for (int k = 0; k < 8; ++k) shapes.push_back({16, 1024}), shapes.push_back({128, 128});
  shapes.push_back({64, 300}), shapes.push_back({300, 64}), shapes.push_back({40, 40});
  run_ranks(4, [&](std::shared_ptr<ProcessGroup> g) {
    Params matrices, others;
    for (const auto& s : shapes) matrices.push_back(at::zeros(s).requires_grad_());
    for (int k = 0; k < 3; ++k) others.push_back(at::zeros({100}).requires_grad_());
    OSS oss({{matrices, optimizer<Muon>(MuonOptions(0.02))}, {others, optimizer<optim::AdamW>(adamw_options())}},
            g);
    std::vector<double> cost(4, 0.0);
    double largest = 0, total = 0;
    for (const auto& m : matrices) {
      const int owner = oss.owner(m);
      ASSERT_GE(owner, 0);
      cost[owner] += muon_cost(m.sizes());
      largest = std::max(largest, muon_cost(m.sizes()));
      total += muon_cost(m.sizes());
    }
    const double mean = total / 4, busiest = *std::max_element(cost.begin(), cost.end());
    // No whole-matrix placement can do better than max(mean, largest); the partition (largest
    // first, then moves and swaps) stays within 4/3 of that, and here within 5% of the mean.
    EXPECT_LE(busiest, 4.0 / 3.0 * std::max(mean, largest));
    EXPECT_LE(busiest / mean - 1, 0.05) << oss.describe();
    // The same matrices balanced by bytes leave a rank with far more than its share of the cost.
    std::vector<int64_t> bytes;
    for (const auto& m : matrices) bytes.push_back(m.numel() * 4);
    const Partition by_bytes = Partition::balance(bytes, 4);
    std::vector<double> bytes_cost(4, 0.0);
    for (size_t i = 0; i < matrices.size(); ++i) bytes_cost[by_bytes.owner(i)] += muon_cost(matrices[i].sizes());
    EXPECT_GT(*std::max_element(bytes_cost.begin(), bytes_cost.end()) / mean - 1, 0.2);
    EXPECT_NE(oss.describe().find("whole-tensor cost"), std::string::npos) << oss.describe();
    EXPECT_NE(oss.describe().find("rank 3:"), std::string::npos) << oss.describe();
  });
}

// Freezing matrices re-balances the cost of the ones still trained; only owners that change move
// state, and training goes on equal to plain Muon.
TEST(MixedOptimizers, FreezingMatricesRebalancesTheirCost) {
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    std::vector<std::vector<int64_t>> shapes{{32, 32}, {32, 32}, {32, 32}, {32, 32}, {8, 64}, {8, 64}};
    Params params, ref;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    for (const auto& s : shapes) {
      params.push_back(at::randn(s, gen).requires_grad_());
      ref.push_back(params.back().detach().clone().requires_grad_());
    }
    OSS oss(params, optimizer<Muon>(muon_options()), g);
    Muon ref_opt(ref, muon_options());
    // Each matrix whole on one owner, in row buckets (Note [Rows of whole parameters]).
    for (const auto& p : params) ASSERT_EQ(oss.owners(p).size(), 1u) << oss.describe();
    ASSERT_TRUE(oss.layout().groups().at(0).rows) << oss.describe();
    for (int step = 0; step < 6; ++step) {
      // The two square matrices on one rank frozen from step 2: the other rank has the work.
      if (step == 2) {
        std::vector<size_t> on_zero;
        for (size_t i = 0; i < 4; ++i) {
          if (oss.owner(params[i]) == 0) on_zero.push_back(i);
        }
        ASSERT_EQ(on_zero.size(), 2u) << oss.describe();
        for (size_t i : on_zero) params[i].requires_grad_(false), ref[i].requires_grad_(false);
      }
      for (size_t i = 0; i < params.size(); ++i) {
        const at::Tensor grad = at::sin(at::arange(params[i].numel()).to(at::kFloat) * 0.3 + step + i)
                                    .reshape(params[i].sizes());
        params[i].mutable_grad() = params[i].requires_grad() ? grad.clone() : at::Tensor();
        ref[i].mutable_grad() = ref[i].requires_grad() ? grad.clone() : at::Tensor();
      }
      oss.step();
      ref_opt.step();
      ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-6)) << "step " << step;
      if (step == 2) {
        // Two square matrices left: one per rank, and one of them moved with its momentum.
        EXPECT_GE(Introspection::partition_version(oss), 1) << oss.describe();
        std::vector<int> owners;
        for (size_t i = 0; i < 4; ++i) {
          if (params[i].requires_grad()) owners.push_back(oss.owner(params[i]));
        }
        ASSERT_EQ(owners.size(), 2u);
        EXPECT_NE(owners[0], owners[1]) << oss.describe();
        EXPECT_LE(oss.last_rebalance().params_moved, 2) << oss.describe();
      }
    }
  });
}

// The consolidated state of a Muon + AdamW OSS is PyTorch's layout: one param group per
// optimizer with that optimizer's keys, the state of every parameter under its index.
TEST(MixedOptimizers, ConsolidatedStateKeepsEachOptimizersLayout) {
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = token_net(9);
    Params params = net->parameters();
    OSS oss = muon_and_adamw(params, g);
    const auto data = testing::rank_data(0, g->rank(), 4);
    oss.zero_grad();
    testing::loss_of(net->forward(tokens(data.x)), data, 4).backward();
    testing::allreduce_grads(params, *g);
    oss.step();
    oss.consolidate_state_dict(0);
    if (g->rank() != 0) return;
    const auto dict = oss.state_dict().toGenericDict();
    const auto groups = dict.at("param_groups").toListRef();
    ASSERT_EQ(groups.size(), 2u);
    EXPECT_TRUE(groups[0].toGenericDict().contains("ns_coefficients"));
    EXPECT_TRUE(groups[1].toGenericDict().contains("betas"));
    const auto state = dict.at("state").toGenericDict();
    ASSERT_EQ(state.size(), 7u);
    // Indices in group order: the two matrices first (momentum only), then AdamW's five.
    EXPECT_TRUE(state.at(0).toGenericDict().contains("momentum_buffer"));
    EXPECT_FALSE(state.at(0).toGenericDict().contains("exp_avg"));
    EXPECT_TRUE(state.at(2).toGenericDict().contains("exp_avg_sq"));
    EXPECT_EQ(state.at(1).toGenericDict().at("momentum_buffer").toTensor().sizes(), params[3].sizes());
  });
}

// Mixed precision: bf16 parameters, gradients reduced in fp32, fp32 masters and state on the
// owners. Against a reference that steps fp32 masters with plain Muon + AdamW on the all-reduced
// (fp32) gradients of the same bf16 model and copies them back rounded: at two ranks each reduced
// element is one addition, so both see the same gradients, take the same steps on the CPU, and
// the bf16 parameters agree bit for bit, through a freeze of the hidden matrix.
TEST(MixedOptimizers, MuonAndAdamWUnderMixedPrecisionFollowFp32Masters) {
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = token_net(4), ref_net = token_net(4);
    Params params = net->parameters(), ref = ref_net->parameters();
    Params masters;
    for (const auto& p : ref) masters.push_back(p.detach().clone().requires_grad_());
    ref_net->to(at::kBFloat16);
    OSS oss = muon_and_adamw(params, g, OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));
    ShardedDDP ddp(net.ptr(), oss);
    Muon ref_muon(pick(masters, kMatrices), muon_options());
    optim::AdamW ref_adamw(pick(masters, kOthers), adamw_options());
    for (int step = 0; step < 6; ++step) {
      const bool frozen = step >= 2 && step < 4;
      params[3].requires_grad_(!frozen), ref[3].requires_grad_(!frozen), masters[3].requires_grad_(!frozen);
      const auto data = testing::rank_data(step, g->rank(), 4);
      ddp.zero_grad();
      testing::loss_of(ddp.forward(tokens(data.x)), data, 4).backward();
      oss.step();

      for (auto& p : ref) p.mutable_grad() = at::Tensor();
      testing::loss_of(ref_net->forward(tokens(data.x)), data, 4).backward();
      for (size_t i = 0; i < ref.size(); ++i) {
        masters[i].mutable_grad() = ref[i].grad().defined() ? ref[i].grad().to(at::kFloat) : at::Tensor();
      }
      testing::allreduce_grads(masters, *g);
      ref_muon.step();
      ref_adamw.step();
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < ref.size(); ++i) ref[i].copy_(masters[i]);
      ASSERT_EQ(params[0].scalar_type(), at::kBFloat16);
      ASSERT_TRUE(testing::matches_reference(params, ref, *g, 0.0)) << "step " << step;
    }
  });
}

// A LibTorch LR scheduler over the OSS reaches every optimizer group: each local optimizer steps
// with its group's new rate, as each of torch.optim.Muon and AdamW would.
// Muon on int8 wires (Note [Int8 wire]): its matrices' gradients are quantised per block on the
// way to their owners like AdamW's, and the owners' fp32 masters are sent quantised. Through a
// freeze of a matrix, with error feedback, at worlds 2 and 3: every rank holds the same
// parameters, each within half a step of its block of the owners' masters, and the run stays
// within 5% of the same run on exact wires.
TEST(MixedOptimizers, MuonMatricesTravelOnInt8WiresLikeTheRest) {
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = token_net(5), exact_net = token_net(5);
      Params params = net->parameters(), exact = exact_net->parameters();
      OSS oss = muon_and_adamw(params, g, OSSOptions().param_wire(Wire::kInt8));
      ShardedDDP ddp(net.ptr(), oss,
                     ShardedDDPOptions().reduce_bucket_bytes(512).gradient_wire(Wire::kInt8).error_feedback(true));
      OSS exact_oss = muon_and_adamw(exact, g);
      ShardedDDP exact_ddp(exact_net.ptr(), exact_oss, ShardedDDPOptions().reduce_bucket_bytes(512));
      Params in_oss_order = pick(params, kMatrices);  // the masters' order: Muon's group, then AdamW's
      for (const auto& p : pick(params, kOthers)) in_oss_order.push_back(p);
      for (int step = 0; step < 6; ++step) {
        const bool frozen = step == 2 || step == 3;
        params[3].requires_grad_(!frozen);
        exact[3].requires_grad_(!frozen);
        const auto data = testing::rank_data(step, g->rank(), 4);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        for (auto [d, o] : {std::pair{&ddp, &oss}, std::pair{&exact_ddp, &exact_oss}}) {
          d->zero_grad();
          testing::loss_of(d->forward(tokens(data.x)), data, 4).backward();
          o->step();
        }
        ASSERT_TRUE(testing::same_on_all_ranks(params, *g)) << "step " << step;
        // (A block of 256 may hold pieces of several parameters: the largest master bounds its scale.)
        const Params masters = testing::consolidated_masters(oss, in_oss_order.size());
        double largest = 0, off = 0;
        for (size_t i = 0; i < masters.size(); ++i) {
          largest = std::max(largest, masters[i].abs().max().item<double>());
          off = std::max(off, (in_oss_order[i] - masters[i]).abs().max().item<double>());
        }
        if (g->rank() == 0) {
          EXPECT_LE(off, largest / 254 * 1.0001) << "step " << step;
          EXPECT_GT(off, 0) << "step " << step << ": int8 rounded nothing";
        }
      }
      for (size_t i : kMatrices) {
        EXPECT_GT((params[i] - exact[i]).abs().max().item<double>(), 0) << "matrix " << i << ": int8 rounded nothing";
        EXPECT_LE(testing::rel_diff(params[i], exact[i]), 0.05) << "matrix " << i;
      }
      for (size_t i : kOthers) EXPECT_LE(testing::rel_diff(params[i], exact[i]), 0.05) << "parameter " << i;
    });
  }
}

TEST(MixedOptimizers, AnLrSchedulerReachesEveryOptimizerGroup) {
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = token_net(3);
    Params params = net->parameters();
    OSS oss = muon_and_adamw(params, g);
    optim::StepLR schedule(oss, /*step_size=*/1, /*gamma=*/0.5);
    for (int step = 0; step < 3; ++step) {
      const auto data = testing::rank_data(step, g->rank(), 4);
      oss.zero_grad();
      testing::loss_of(net->forward(tokens(data.x)), data, 4).backward();
      testing::allreduce_grads(params, *g);
      oss.step();
      // LibTorch's StepLR leaves the rate alone at its first step(), then halves it at each.
      const double scale = std::pow(0.5, std::max(0, step - 1));
      EXPECT_DOUBLE_EQ(oss.param_groups()[0].options().get_lr(), 0.02 * scale);
      EXPECT_DOUBLE_EQ(Introspection::local_optimizer(oss, 0).param_groups()[0].options().get_lr(), 0.02 * scale);
      EXPECT_DOUBLE_EQ(Introspection::local_optimizer(oss, 1).param_groups()[0].options().get_lr(), 3e-3 * scale);
      schedule.step();
    }
  });
}

// Muon refuses a parameter that is not 2-D; only its owner builds the Muon that sees it, and every
// rank fails with PyTorch's message, none left waiting.
TEST(MixedOptimizers, AParameterMuonRefusesFailsEveryRankNamingIt) {
  const auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss({{{at::zeros({4, 4}).requires_grad_(), at::zeros({3}).requires_grad_()}, optimizer<Muon>(MuonOptions())}},
            g);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([3])"),
              std::string::npos)
        << e;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
