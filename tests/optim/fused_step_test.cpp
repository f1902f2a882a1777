// The fused step against torch::optim's own step: every option, odd sizes, float and double,
// parameters without a gradient in some steps (and so fewer steps of their own); and OSS using it.
#include <shardopt/optim/fused_step.h>
#include <shardopt/optim/oss.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/rmsprop.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <cstdlib>
#include <functional>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;
using Make = std::function<std::unique_ptr<optim::Optimizer>(const Params&)>;

Params make(at::ScalarType dtype) {
  at::manual_seed(5);
  Params ps;
  for (int64_t n : {1, 7, 33, 1023, 100003}) ps.push_back(at::randn({n}, dtype).requires_grad_());
  ps.push_back(at::randn({17, 9}, dtype).requires_grad_());
  return ps;
}

Params copy(const Params& ps) {
  Params out;
  for (const auto& p : ps) out.push_back(p.detach().clone().requires_grad_());
  return out;
}

// Runs 6 steps of `make`'s optimizer on two copies, one with step(), one with fused_step(), with
// the same gradients; parameter 1 has no gradient in steps 2-3 and parameter 3 none in step 4.
void expect_same_as_torch(const Make& make_opt, at::ScalarType dtype, const std::string& name) {
  Params a = make(dtype), b = copy(a);
  auto ta = make_opt(a), tb = make_opt(b);
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < a.size(); ++i) {
      const bool none = (i == 1 && (step == 2 || step == 3)) || (i == 3 && step == 4);
      if (none) {
        a[i].mutable_grad().reset();
        b[i].mutable_grad().reset();
        continue;
      }
      at::Tensor g = at::randn_like(a[i]) * (1.0 + step);
      a[i].mutable_grad() = g.clone();
      b[i].mutable_grad() = g.clone();
    }
    ta->step();
    ASSERT_EQ(fused_step_unsupported(*tb), "") << name;
    fused_step(*tb);
    for (size_t i = 0; i < a.size(); ++i) {
      // The portable build rounds multiply-adds in two steps where ATen's kernels fuse them.
      const double tolerance = dtype == at::kDouble ? 1e-12 : (testing::Introspection::cpu_kernel_level() == 0 ? 1e-5 : 1e-6);
      ASSERT_LE(testing::rel_diff(b[i], a[i]), tolerance)
          << name << ", parameter " << i << " (" << a[i].numel() << " elements) after step " << step;
    }
  }
  // The state is torch::optim's, in its layout: the same step counts and buffers.
  for (size_t i = 0; i < a.size(); ++i) {
    const bool has_state = ta->state().count(a[i].unsafeGetTensorImpl()) > 0;
    ASSERT_EQ(tb->state().count(b[i].unsafeGetTensorImpl()) > 0, has_state) << name << ", parameter " << i;
    if (!has_state) continue;  // SGD without momentum keeps none
    auto& sa = *ta->state().at(a[i].unsafeGetTensorImpl());
    auto& sb = *tb->state().at(b[i].unsafeGetTensorImpl());
    if (auto* adam = dynamic_cast<optim::AdamParamState*>(&sa)) {
      auto& fused = dynamic_cast<optim::AdamParamState&>(sb);
      EXPECT_EQ(fused.step(), adam->step()) << name << ", parameter " << i;
      EXPECT_LE(testing::rel_diff(fused.exp_avg_sq(), adam->exp_avg_sq()), 1e-6) << name;
    } else if (auto* sgd = dynamic_cast<optim::SGDParamState*>(&sa)) {
      EXPECT_LE(testing::rel_diff(dynamic_cast<optim::SGDParamState&>(sb).momentum_buffer(), sgd->momentum_buffer()), 1e-6);
    }
  }
  auto it = tb->state().find(b[1].unsafeGetTensorImpl());
  if (it != tb->state().end() && dynamic_cast<optim::AdamParamState*>(it->second.get())) {
    EXPECT_EQ(dynamic_cast<optim::AdamParamState&>(*it->second).step(), 4)
        << name << ": the parameter without a gradient in two of six steps took four";
  }
}

// Each build of the loops (AVX-512, AVX2 + FMA, portable) where this CPU runs it.
class FusedStepBuilds : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { testing::Introspection::cap_cpu_kernels(GetParam()); }
  void TearDown() override { testing::Introspection::cap_cpu_kernels(-1); }
};
INSTANTIATE_TEST_SUITE_P(FusedStep, FusedStepBuilds, ::testing::Values(2, 1, 0),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == 2 ? "avx512" : info.param == 1 ? "avx2" : "default");
                         });

TEST_P(FusedStepBuilds, AdamAndAdamWEqualTorchOptimForEveryOption) {
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (double wd : {0.0, 0.1}) {
      for (bool ams : {false, true}) {
        expect_same_as_torch([&](const Params& p) {
          return std::make_unique<optim::Adam>(p, optim::AdamOptions(1e-2).betas({0.8, 0.95}).eps(1e-6).weight_decay(wd).amsgrad(ams));
        }, dtype, "Adam wd " + std::to_string(wd) + " amsgrad " + std::to_string(ams));
        expect_same_as_torch([&](const Params& p) {
          return std::make_unique<optim::AdamW>(p, optim::AdamWOptions(1e-2).weight_decay(wd).amsgrad(ams));
        }, dtype, "AdamW wd " + std::to_string(wd) + " amsgrad " + std::to_string(ams));
      }
    }
  }
}

TEST_P(FusedStepBuilds, SgdEqualsTorchOptimForEveryOption) {
  struct Case { double momentum, dampening, wd; bool nesterov; };
  for (auto dtype : {at::kFloat, at::kDouble}) {
    for (Case c : {Case{0, 0, 0, false}, Case{0, 0, 0.01, false}, Case{0.9, 0, 0, false}, Case{0.9, 0.1, 0.01, false},
                   Case{0.9, 0, 0.01, true}}) {
      expect_same_as_torch([&](const Params& p) {
        return std::make_unique<optim::SGD>(
            p, optim::SGDOptions(0.05).momentum(c.momentum).dampening(c.dampening).weight_decay(c.wd).nesterov(c.nesterov));
      }, dtype, "SGD momentum " + std::to_string(c.momentum) + " nesterov " + std::to_string(c.nesterov));
    }
  }
}

TEST(FusedStep, OtherOptimizersAndTensorsAreNamedNotStepped) {
  Params p = make(at::kFloat);
  optim::RMSprop rms(p, optim::RMSpropOptions(1e-2));
  EXPECT_NE(fused_step_unsupported(rms).find("not torch::optim::Adam, AdamW or SGD"), std::string::npos);
  Params q = {at::randn({4, 4}).requires_grad_()};
  q[0].mutable_grad() = at::randn({4, 4}).t();  // not contiguous
  optim::Adam adam(q, optim::AdamOptions(1e-2));
  EXPECT_NE(fused_step_unsupported(adam).find("not a dense contiguous"), std::string::npos);
}

// OSS uses the fused step for Adam by default and the wrapped step when asked or when it cannot.
TEST(FusedStep, OssStepsFusedByDefaultAndMatchesTheUnfusedPath) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    Params a = testing::make_params(), b = testing::make_params();
    OSS fused(a, optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.1)), g);
    OSS plain(b, optimizer<optim::AdamW>(optim::AdamWOptions(1e-2).weight_decay(0.1)), g, OSSOptions().fused_step(false));
    for (int step = 0; step < 4; ++step) {
      for (auto* ps : {&a, &b}) {
        auto data = testing::rank_data(step, g->rank(), 3);
        testing::loss(*ps, data, 3).backward();
        testing::allreduce_grads(*ps, *g);
      }
      fused.step();
      plain.step();
      fused.zero_grad();
      plain.zero_grad();
      ASSERT_TRUE(testing::Introspection::stepped_fused(fused));
      ASSERT_FALSE(testing::Introspection::stepped_fused(plain));
    }
    for (size_t i = 0; i < a.size(); ++i) EXPECT_LE(testing::rel_diff(a[i], b[i]), 1e-6) << "parameter " << i;
    OSS rms(testing::make_params(), optimizer<optim::RMSprop>(optim::RMSpropOptions(1e-2)), g);
    rms.step();
    EXPECT_FALSE(testing::Introspection::stepped_fused(rms));
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
