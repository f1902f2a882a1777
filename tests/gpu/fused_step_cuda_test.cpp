// The fused step on CUDA tensors (kernels/'s Adam/AdamW and SGD kernels through csrc/cuda/)
// against torch::optim's own step on CPU copies and against the CPU fused step, on the same data:
// every option, odd sizes, parameters without a gradient in some steps. Runs where a CUDA device
// is visible and is reported as skipped (not passed) everywhere else.
#include <shardopt/optim/fused_step.h>

#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <functional>
#include <string>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;
using Make = std::function<std::unique_ptr<optim::Optimizer>(const Params&)>;

Params copy_to(const Params& ps, at::Device device) {
  Params out;
  for (const auto& p : ps) out.push_back(p.detach().to(device, /*non_blocking=*/false, /*copy=*/true).requires_grad_());
  return out;
}

// Six steps of three copies: torch::optim on CPU (the reference), the fused step on CPU and the
// fused step on CUDA, with the same gradients; parameter 1 has no gradient in steps 2-3.
void expect_cuda_matches(const Make& make_opt, const std::string& name) {
  at::manual_seed(11);
  Params ref;
  for (int64_t n : {1, 7, 33, 1023, 100003}) ref.push_back(at::randn({n}).requires_grad_());
  ref.push_back(at::randn({17, 9}).requires_grad_());
  Params cpu = copy_to(ref, at::kCPU), cuda = copy_to(ref, at::kCUDA);
  auto o_ref = make_opt(ref), o_cpu = make_opt(cpu), o_cuda = make_opt(cuda);
  for (int step = 0; step < 6; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      at::Tensor g;
      if (!(i == 1 && (step == 2 || step == 3))) g = at::randn_like(ref[i]) * (1.0 + step);
      ref[i].mutable_grad() = g.defined() ? g.clone() : at::Tensor();
      cpu[i].mutable_grad() = g.defined() ? g.clone() : at::Tensor();
      cuda[i].mutable_grad() = g.defined() ? g.to(at::kCUDA) : at::Tensor();
    }
    o_ref->step();
    ASSERT_EQ(fused_step_unsupported(*o_cpu), "") << name;
    ASSERT_EQ(fused_step_unsupported(*o_cuda), "") << name;
    fused_step(*o_cpu);
    fused_step(*o_cuda);
    for (size_t i = 0; i < ref.size(); ++i) {
      const at::Tensor on_host = cuda[i].detach().cpu();
      ASSERT_LE(testing::rel_diff(on_host, ref[i]), 1e-6)
          << name << ": parameter " << i << " (" << ref[i].numel() << " elements) after step " << step;
      // The kernels round in the CPU step's order: the same bits.
      ASSERT_TRUE(on_host.equal(cpu[i].detach()))
          << name << ": parameter " << i << " after step " << step << " differs from the CPU fused step by "
          << (on_host - cpu[i].detach()).abs().max().item<float>();
    }
  }
  auto it = o_cuda->state().find(cuda[1].unsafeGetTensorImpl());
  if (it == o_cuda->state().end()) return;  // SGD without momentum keeps none
  if (auto* adam = dynamic_cast<optim::AdamParamState*>(it->second.get())) {
    EXPECT_TRUE(adam->exp_avg().is_cuda());
    EXPECT_EQ(adam->step(), 4) << name << ": the parameter without a gradient in two of six steps took four";
  }
}

TEST(CudaFusedStep, AdamAdamWAndSgdEqualTorchOptimAndTheCpuFusedStep) {
  if (!at::globalContext().hasCUDA()) GTEST_SKIP() << "no CUDA device visible: not run";
  for (const double wd : {0.0, 0.1}) {
    for (const bool ams : {false, true}) {
      const std::string tag = " wd " + std::to_string(wd) + (ams ? " amsgrad" : "");
      expect_cuda_matches([&](const Params& p) {
        return std::make_unique<optim::Adam>(p, optim::AdamOptions(1e-2).betas({0.8, 0.95}).eps(1e-6).weight_decay(wd).amsgrad(ams));
      }, "Adam" + tag);
      expect_cuda_matches([&](const Params& p) {
        return std::make_unique<optim::AdamW>(p, optim::AdamWOptions(1e-2).weight_decay(wd).amsgrad(ams));
      }, "AdamW" + tag);
    }
  }
  struct Sgd {
    double momentum, dampening, wd;
    bool nesterov;
  };
  for (const Sgd& c : {Sgd{0, 0, 0, false}, Sgd{0.9, 0, 0, false}, Sgd{0.9, 0, 1e-2, true}, Sgd{0.9, 0.1, 1e-2, false}}) {
    expect_cuda_matches([&](const Params& p) {
      return std::make_unique<optim::SGD>(
          p, optim::SGDOptions(0.05).momentum(c.momentum).dampening(c.dampening).weight_decay(c.wd).nesterov(c.nesterov));
    }, "SGD momentum " + std::to_string(c.momentum) + " dampening " + std::to_string(c.dampening) + " wd " +
           std::to_string(c.wd) + (c.nesterov ? " nesterov" : ""));
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
