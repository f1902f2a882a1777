// Mixed precision (OSSOptions::mixed_precision) and the sharded gradient scaler, against a
// single-process reference that follows the same recipe with plain torch::optim::Adam: fp32
// master weights, low-precision copies for forward and backward, gradients averaged in the
// reduction dtype, clipped and unscaled there, upcast, stepped in fp32, rounded back.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/grad_scaler.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"
#include "optim/master_recipe.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/rmsprop.h>

#include <cmath>
#include <functional>
#include <limits>
#include <optional>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;
using Net = testing::NamedNet;
using testing::consolidated_masters;

constexpr double kLr = 1e-2;

OptimizerFactory adam() { return optimizer<optim::Adam>(optim::AdamOptions(kLr)); }

// The reference: the recipe at kLr.
struct Recipe : testing::MasterRecipe {
  Recipe(c10::ScalarType dtype, c10::ScalarType reduce, int world) : MasterRecipe(dtype, reduce, world, kLr) {}
};

struct Case {
  c10::ScalarType dtype, reduce;
  int world;
  PartitionMode partition;
  int shard_group_size = 0;      // hierarchical sharding
  bool overlap_sync = false;     // ShardedDDPOptions::overlap_param_sync
};

TEST(MixedPrecision, ShardedDdpFollowsTheRecipeWithFreezingAndClipping) {
  for (const Case& c : {Case{at::kBFloat16, at::kFloat, 3, PartitionMode::kWholeParameters},
                        Case{at::kBFloat16, at::kFloat, 3, PartitionMode::kSplit},
                        Case{at::kBFloat16, at::kBFloat16, 2, PartitionMode::kSplit},
                        Case{at::kHalf, at::kFloat, 2, PartitionMode::kWholeParameters},
                        Case{at::kBFloat16, at::kFloat, 4, PartitionMode::kSplit, /*shard_group_size=*/2},
                        Case{at::kBFloat16, at::kFloat, 2, PartitionMode::kWholeParameters, 0, /*overlap_sync=*/true}}) {
    SCOPED_TRACE(std::string(c10::toString(c.dtype)) + " reduced in " + c10::toString(c.reduce) + " at world " +
                 std::to_string(c.world) + (c.partition == PartitionMode::kSplit ? ", split" : ", whole") +
                 ", shard_group_size " + std::to_string(c.shard_group_size) + (c.overlap_sync ? ", overlapped sync" : ""));
    testing::run_ranks(c.world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g,
              OSSOptions().partition(c.partition).shard_group_size(c.shard_group_size).mixed_precision(
                  MixedPrecision().param_dtype(c.dtype).reduce_dtype(c.reduce)));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64).overlap_param_sync(c.overlap_sync));
      Recipe ref(c.dtype, c.reduce, c.world);
      for (const auto& p : net->params) ASSERT_EQ(p.scalar_type(), c.dtype) << "the module runs in param_dtype";
      for (int step = 0; step < 6; ++step) {
        const bool freeze = step == 2 || step == 3;
        net->params[2].requires_grad_(!freeze);
        net->params[3].requires_grad_(!freeze);
        const auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();  // forward() casts x
        oss.clip_grad_norm(0.5);
        oss.step();
        ddp.finish_param_sync();
        ref.step(step, {false, false, freeze, freeze, false}, 0.5);
        for (size_t i = 0; i < ref.master.size(); ++i) {
          // The rounded masters, one param_dtype step apart at most where fp32 sums differ in
          // their last bit.
          EXPECT_LE(testing::rel_diff(net->params[i].to(at::kFloat), ref.master[i].to(c.dtype).to(at::kFloat)), 1e-2)
              << "step " << step << " parameter " << i;
        }
        ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g)) << "step " << step;
        const Params masters = consolidated_masters(oss, ref.master.size());
        for (size_t i = 0; i < masters.size(); ++i) {
          ASSERT_EQ(masters[i].scalar_type(), at::kFloat);
          EXPECT_LE(testing::rel_diff(masters[i], ref.master[i]), 1e-4) << "step " << step << " master " << i;
        }
      }
      // The masters carry what the low-precision copy cannot hold.
      if (g->rank() == 0) {
        const Params masters = consolidated_masters(oss, ref.master.size());
        EXPECT_GT(testing::rel_diff(masters[0], net->params[0].to(at::kFloat)), 1e-5);
      } else {
        consolidated_masters(oss, ref.master.size());
      }
    });
  }
}

TEST(MixedPrecision, MasterWeightsAndStateAreTwelveBytesOverWorldAndGradientsTwo) {
  for (int world : {2, 4}) {
    testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = torch::nn::Sequential(torch::nn::Linear(256, 256), torch::nn::ReLU(), torch::nn::Linear(256, 256),
                                       torch::nn::ReLU(), torch::nn::Linear(256, 64));
      testing::fill_seeded(net->parameters(), 3, 0.05);
      int64_t psi = 0;
      for (const auto& p : net->parameters()) psi += p.numel();
      OSS oss(net->parameters(), adam(), g,
              OSSOptions().partition(PartitionMode::kSplit).mixed_precision(
                  MixedPrecision().param_dtype(at::kBFloat16)));
      ShardedDDP ddp(net.ptr(), oss);
      for (int step = 0; step < 2; ++step) {
        ddp.zero_grad();
        at::Tensor x = testing::seeded_randn({8, 256}, 100 * step + g->rank());
        ddp.forward(x).to(at::kFloat).pow(2).mean().backward();
        const double grads = static_cast<double>(ddp.local_grad_bytes());
        EXPECT_NEAR(grads / (2.0 * psi / world), 1.0, 0.03) << "gradient bytes, rank " << g->rank();
        oss.step();
      }
      const double state = static_cast<double>(oss.local_state_bytes() + oss.local_master_bytes());
      EXPECT_NEAR(state / (12.0 * psi / world), 1.0, 0.03) << "state + master bytes, rank " << g->rank();
      EXPECT_NEAR(static_cast<double>(oss.local_master_bytes()) / (4.0 * psi / world), 1.0, 0.03);
      int64_t param_bytes = 0;
      for (const auto& p : net->parameters()) param_bytes += p.numel() * static_cast<int64_t>(p.element_size());
      EXPECT_EQ(param_bytes, 2 * psi);
    });
  }
}

TEST(MixedPrecision, GradScalerSkipsTheSameStepOnEveryRankWhenOneRankOverflows) {
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g,
            OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kFloat)));
    ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64));
    ShardedGradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
    Recipe ref(at::kHalf, at::kFloat, 2);
    const std::vector<double> scales_after{1024, 2048, 1024, 1024, 2048};
    for (int step = 0; step < 5; ++step) {
      const bool overflow = step == 2;
      const double scale = scaler.get_scale();
      const auto data = testing::rank_data(step, g->rank(), 3);
      // Only rank 1's gradient of w1 overflows; its owner sees inf after the reduction.
      unsigned hook = 0;
      if (overflow && g->rank() == 1) {
        hook = net->params[0].register_hook(
            [](const at::Tensor& grad) { return at::full_like(grad, std::numeric_limits<float>::infinity()); });
      }
      Params before;
      if (overflow) before = consolidated_masters(oss, net->params.size());
      const Params params_before = testing::clone_params(net->params);
      ddp.zero_grad();
      scaler.scale(testing::loss_of(ddp.forward(data.x), data, 3)).backward();
      if (overflow && g->rank() == 1) net->params[0].remove_hook(hook);
      scaler.unscale_(oss);
      oss.clip_grad_norm(0.5);
      const bool stepped = scaler.step(oss);
      scaler.update();
      EXPECT_EQ(stepped, !overflow) << "step " << step << " on rank " << g->rank();
      EXPECT_EQ(scaler.get_scale(), scales_after[step]) << "step " << step;
      ref.step(step, {false, false, false, false, false}, 0.5, scale, overflow);
      if (overflow) {
        for (size_t i = 0; i < net->params.size(); ++i) EXPECT_TRUE(net->params[i].equal(params_before[i]));
        const Params after = consolidated_masters(oss, net->params.size());
        for (size_t i = 0; i < after.size(); ++i) EXPECT_TRUE(after[i].equal(before[i])) << "master " << i;
      }
      const Params masters = consolidated_masters(oss, ref.master.size());
      for (size_t i = 0; i < masters.size(); ++i) {
        EXPECT_LE(testing::rel_diff(masters[i], ref.master[i]), 1e-4) << "step " << step << " master " << i;
      }
      ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g));
    }
    // The skipped step left Adam's step count behind: 4 steps taken, not 5.
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      const auto state = oss.state_dict().toGenericDict().at("state").toGenericDict();
      const c10::IValue steps = state.at(int64_t{0}).toGenericDict().at("step");
      EXPECT_EQ(steps.isTensor() ? steps.toTensor().item<int64_t>() : steps.toInt(), 4);
    }
  });
}

// scaler.step() without unscale_() unscales inside the fused step (Note [Unscaling in the step]):
// the same parameters, bit for bit, as unscale_() then step(), which follows the recipe; the
// gradients stay scaled; an overflow on one rank skips the step on all of them.
TEST(MixedPrecision, GradScalerFoldsItsUnscaleIntoTheFusedStep) {
  struct ScalerCase {
    std::optional<c10::ScalarType> dtype;  // mixed precision's param_dtype (reduced in fp32); none: fp32
    int world;
    PartitionMode partition;
  };
  for (const ScalerCase& c : {ScalerCase{std::nullopt, 2, PartitionMode::kWholeParameters},
                              ScalerCase{std::nullopt, 3, PartitionMode::kSplit},
                              ScalerCase{at::kHalf, 2, PartitionMode::kSplit}}) {
    SCOPED_TRACE((c.dtype ? std::string(c10::toString(*c.dtype)) : std::string("fp32")) + " at world " +
                 std::to_string(c.world) + (c.partition == PartitionMode::kSplit ? ", split" : ", whole"));
    testing::run_ranks(c.world, [&](std::shared_ptr<ProcessGroup> g) {
      OSSOptions options = OSSOptions().partition(c.partition);
      if (c.dtype) options.mixed_precision(MixedPrecision().param_dtype(*c.dtype).reduce_dtype(at::kFloat));
      // Two identical models: one steps with the unscale folded in, one calls unscale_() first.
      auto folded = std::make_shared<Net>(), unscaled = std::make_shared<Net>();
      OSS folded_oss(folded->parameters(), adam(), g, options), unscaled_oss(unscaled->parameters(), adam(), g, options);
      ShardedDDP folded_ddp(folded, folded_oss, ShardedDDPOptions().reduce_bucket_bytes(64));
      ShardedDDP unscaled_ddp(unscaled, unscaled_oss, ShardedDDPOptions().reduce_bucket_bytes(64));
      ShardedGradScaler folded_scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
      ShardedGradScaler unscaled_scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
      const c10::ScalarType low = c.dtype.value_or(at::kFloat);
      Recipe ref(low, at::kFloat, c.world);
      for (int step = 0; step < 5; ++step) {
        const bool overflow = step == 2;
        const double scale = folded_scaler.get_scale();
        const auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        Params scaled_grads;
        bool stepped[2];
        for (int k = 0; k < 2; ++k) {
          Net& net = k == 0 ? *folded : *unscaled;
          ShardedDDP& ddp = k == 0 ? folded_ddp : unscaled_ddp;
          ShardedGradScaler& scaler = k == 0 ? folded_scaler : unscaled_scaler;
          unsigned hook = 0;
          if (overflow && g->rank() == 1) {  // only rank 1's gradient overflows
            hook = net.params[0].register_hook(
                [](const at::Tensor& grad) { return at::full_like(grad, std::numeric_limits<float>::infinity()); });
          }
          ddp.zero_grad();
          scaler.scale(testing::loss_of(ddp.forward(data.x), data, 3)).backward();
          if (overflow && g->rank() == 1) net.params[0].remove_hook(hook);
          if (k == 0) {
            for (const auto& p : net.params) scaled_grads.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
          } else {
            scaler.unscale_(unscaled_oss);
          }
          stepped[k] = scaler.step(k == 0 ? folded_oss : unscaled_oss);
          scaler.update();
          ddp.finish_param_sync();
        }
        EXPECT_EQ(stepped[0], !overflow) << "step " << step << " on rank " << g->rank();
        EXPECT_EQ(stepped[1], !overflow) << "step " << step << " on rank " << g->rank();
        EXPECT_EQ(folded_scaler.get_scale(), unscaled_scaler.get_scale()) << "step " << step;
        EXPECT_TRUE(testing::Introspection::stepped_fused(folded_oss)) << "step " << step;
        ref.step(step, {false, false, false, false, false}, /*clip=*/0, scale, overflow);
        for (size_t i = 0; i < folded->params.size(); ++i) {
          EXPECT_TRUE(folded->params[i].equal(unscaled->params[i])) << "step " << step << " parameter " << i;
          if (scaled_grads[i].defined() && !overflow) {
            EXPECT_TRUE(folded->params[i].grad().equal(scaled_grads[i])) << "step " << step << " gradient " << i;
          }
        }
        const Params masters = c.dtype ? consolidated_masters(folded_oss, ref.master.size()) : folded->params;
        for (size_t i = 0; i < masters.size(); ++i) {
          EXPECT_LE(testing::rel_diff(masters[i].to(at::kFloat), ref.master[i]), 1e-4) << "step " << step << " master " << i;
        }
        ASSERT_TRUE(testing::same_on_all_ranks(folded->params, *g)) << "step " << step;
      }
      // The skipped step made no step: 4 of 5 counted.
      folded_oss.consolidate_state_dict(0);
      if (g->rank() == 0) {
        const auto state = folded_oss.state_dict().toGenericDict().at("state").toGenericDict();
        const c10::IValue steps = state.at(int64_t{0}).toGenericDict().at("step");
        EXPECT_EQ(steps.isTensor() ? steps.toTensor().item<int64_t>() : steps.toInt(), 4);
      }
    });
  }
}

TEST(MixedPrecision, StateDictCarriesTheMastersToAnotherWorldSize) {
  c10::IValue saved;
  Params masters_saved;
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g,
            OSSOptions().partition(PartitionMode::kSplit).mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    ShardedDDP ddp(net, oss);
    for (int step = 0; step < 3; ++step) {
      const auto data = testing::rank_data(step, g->rank(), 3);
      ddp.zero_grad();
      testing::loss_of(ddp.forward(data.x), data, 3).backward();
      oss.step();
    }
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      saved = oss.state_dict();
      const auto m = saved.toGenericDict().at("master_weights").toGenericDict();
      for (size_t i = 0; i < net->params.size(); ++i) masters_saved.push_back(m.at(static_cast<int64_t>(i)).toTensor());
    }
  });
  testing::run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g,
            OSSOptions().partition(PartitionMode::kWholeParameters).mixed_precision(
                MixedPrecision().param_dtype(at::kBFloat16)));
    oss.load_state_dict(saved);
    oss.consolidate_state_dict(1);
    if (g->rank() == 1) {
      const auto m = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      for (size_t i = 0; i < masters_saved.size(); ++i) {
        EXPECT_TRUE(m.at(static_cast<int64_t>(i)).toTensor().equal(masters_saved[i])) << "master " << i;
      }
    }
    // A state without masters starts them from the parameters.
    auto plain = saved.toGenericDict().copy();
    ASSERT_EQ(plain.erase("master_weights"), 1u);
    oss.load_state_dict(plain);
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      const auto m = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      for (size_t i = 0; i < net->params.size(); ++i) {
        EXPECT_TRUE(m.at(static_cast<int64_t>(i)).toTensor().equal(net->params[i].to(at::kFloat))) << "master " << i;
      }
    }
    // Parameters changed behind the optimizer: refresh_master_weights() starts the masters from
    // them again.
    {
      at::NoGradGuard no_grad;
      for (auto& p : net->params) p.mul_(0.5).add_(0.25);
    }
    oss.refresh_master_weights();
    oss.consolidate_state_dict(2);
    if (g->rank() == 2) {
      const auto m = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      for (size_t i = 0; i < net->params.size(); ++i) {
        EXPECT_TRUE(m.at(static_cast<int64_t>(i)).toTensor().equal(net->params[i].to(at::kFloat)))
            << "master " << i << " after refresh_master_weights()";
      }
    }
  });
}

// A model built in bf16 (or fp64) keeps its values: the masters start from them in fp32.
TEST(MixedPrecision, ParametersOfAnotherFloatingDtypeStartTheMasters) {
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    for (auto dtype : {at::kBFloat16, at::kDouble}) {
      std::vector<at::Tensor> params, original;
      for (const auto& p : testing::make_params()) {
        params.push_back(p.detach().to(dtype).requires_grad_());
        original.push_back(params.back().detach().clone());
      }
      OSS oss(params, adam(), g, OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
      const Params masters = consolidated_masters(oss, params.size());
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_EQ(params[i].scalar_type(), at::kBFloat16);
        EXPECT_TRUE(params[i].equal(original[i].to(at::kBFloat16)));
        if (!masters.empty()) EXPECT_TRUE(masters[i].equal(original[i].to(at::kFloat))) << "master " << i;
      }
    }
  });
}

TEST(MixedPrecision, BadOptionsAreErrorsOnEveryRank) {
  const std::vector<std::pair<MixedPrecision, std::string>> cases{
      {MixedPrecision().param_dtype(at::kDouble), "param_dtype must be kBFloat16 or kHalf, got Double"},
      {MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kHalf),
       "reduce_dtype must be kFloat32 or the param_dtype (BFloat16), got Half"},
      {MixedPrecision().reduce_dtype(at::kFloat), "reduce_dtype is set but param_dtype is not"}};
  for (const auto& [options, message] : cases) {
    const MixedPrecision mp = options;
    auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      OSS oss(testing::make_params(), adam(), g, OSSOptions().mixed_precision(mp));
    });
    for (const auto& e : errors) EXPECT_NE(e.find(message), std::string::npos) << e;
  }
  // One rank's bad option stops every rank, the others naming where to look.
  auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
    OSS oss(testing::make_params(), adam(), g,
            OSSOptions().mixed_precision(MixedPrecision().param_dtype(g->rank() == 1 ? at::kDouble : at::kBFloat16)));
  });
  EXPECT_NE(errors[0].find("another rank has bad options"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("got Double"), std::string::npos) << errors[1];
}

// OSS::step_unscaling, the call ShardedGradScaler::step makes, used directly: gradients scaled by
// S, stepped with inv_scale 1/S, follow plain torch::optim::Adam on the unscaled gradients and
// stay scaled; an inf on one rank skips the step on every rank, the parameters untouched.
TEST(MixedPrecision, StepUnscalingFollowsAdamOnTheUnscaledGradientsAndSkipsTogether) {
  constexpr double kScale = 1024;
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = testing::make_params(), ref = testing::make_params();
    optim::Adam ref_opt(ref, optim::AdamOptions(kLr));
    OSS oss(params, adam(), g);
    ASSERT_TRUE(oss.can_unscale_in_step());
    for (int step = 0; step < 4; ++step) {
      const bool overflow = step == 2;
      const auto data = testing::rank_data(step, g->rank(), 3);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      oss.zero_grad(true);
      (testing::loss(params, data, 3) * kScale).backward();
      if (overflow && g->rank() == 1) params[0].mutable_grad().fill_(std::numeric_limits<float>::infinity());
      testing::allreduce_grads(params, *g);
      const Params scaled = testing::clone_params({params[1].grad()});
      const Params before = testing::clone_params(params);
      EXPECT_EQ(oss.step_unscaling(1.0 / kScale), !overflow) << "step " << step << ", rank " << g->rank();
      EXPECT_TRUE(params[1].grad().equal(scaled[0])) << "the gradients stay scaled";
      if (overflow) {
        for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before[i])) << "parameter " << i;
        continue;
      }
      ref_opt.zero_grad(true);
      testing::loss(ref, data, 3).backward();
      testing::allreduce_grads(ref, *g);
      ref_opt.step();
      ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << "step " << step;
    }
  });
  // A bad scale, and optimizers the fused step does not take: one line on every rank.
  const std::vector<std::pair<std::function<void(std::shared_ptr<ProcessGroup>)>, std::string>> cases{
      {[](std::shared_ptr<ProcessGroup> g) { OSS(testing::make_params(), adam(), g).step_unscaling(0); },
       "inv_scale must be finite and positive, got 0"},
      {[](std::shared_ptr<ProcessGroup> g) {
         OSS(testing::make_params(), adam(), g).step_unscaling(std::numeric_limits<double>::infinity());
       },
       "inv_scale must be finite and positive, got inf"},
      {[](std::shared_ptr<ProcessGroup> g) {
         OSS(testing::make_params(), adam(), g, OSSOptions().fused_step(false)).step_unscaling(1);
       },
       "OSSOptions::fused_step is off"},
      {[](std::shared_ptr<ProcessGroup> g) {
         OSS oss(testing::make_params(), optimizer<optim::RMSprop>(optim::RMSpropOptions(kLr)), g);
         EXPECT_FALSE(oss.can_unscale_in_step());
         oss.step_unscaling(1);
       },
       "param group 0's is torch::optim::RMSprop"}};
  for (const auto& [body, message] : cases) {
    auto errors = testing::run_ranks_collect_errors(2, body);
    for (const auto& e : errors) EXPECT_NE(e.find(message), std::string::npos) << e;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
