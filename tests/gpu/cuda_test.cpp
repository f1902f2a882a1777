// OSS and ShardedDDP on CUDA tensors over NCCL. These run where a CUDA device is visible and are
// reported as skipped (not passed) everywhere else.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/grad_scaler.h>
#include <shardopt/optim/fused_step.h>
#include <shardopt/optim/mixed_precision.h>
#include <shardopt/testing/introspection.h>

#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <limits>
#include <thread>
#include <utility>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;

#define SHARDOPT_NEEDS_CUDA() \
  if (!at::globalContext().hasCUDA()) GTEST_SKIP() << "no CUDA device visible: not run"

std::shared_ptr<ProcessGroup> nccl_world_of_one() {
  return init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("nccl").rank(0).world_size(1));
}

TEST(Cuda, NcclGroupRefusesCpuParametersNamingThem) {
  SHARDOPT_NEEDS_CUDA();
  auto g = nccl_world_of_one();
  std::vector<at::Tensor> params{at::zeros({4}).requires_grad_()};
  try {
    OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    ADD_FAILURE() << "a CPU parameter in an NCCL group must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("parameter 0 is on cpu but the process group uses NCCL"), std::string::npos)
        << e.what();
  }
}

// A collective that a peer never joins is an error naming the collective and the rank, within
// the group's timeout, not a hang: rank 1 of an NCCL world of 2 joins the group but never calls
// the all-reduce rank 0 waits in (both in this process, so one GPU is enough: rank 1 never makes
// an NCCL communicator). c10d reads TORCH_NCCL_NONBLOCKING_TIMEOUT once per process (Note [NCCL
// timeouts]), so the scenario runs in a fresh process of its own (gtest's threadsafe death-test
// style re-executes this binary for this one test), where its 5 s group is the first.
TEST(Cuda, NcclCollectiveThatAPeerNeverJoinsTimesOutNamingItAndTheRank) {
  SHARDOPT_NEEDS_CUDA();
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto scenario = [] {
    setenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", "5", /*overwrite=*/1);  // inherited from this process's groups
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto options = [](int rank) {
      return InitOptions().backend("nccl").rank(rank).world_size(2).timeout(std::chrono::seconds(5));
    };
    std::promise<void> done;
    std::thread peer([&, finished = done.get_future()]() mutable {
      auto g = init_process_group(store, options(1));
      finished.wait();
    });
    std::string error = "no error";
    const auto start = std::chrono::steady_clock::now();
    try {
      auto g = init_process_group(store, options(0));
      at::Tensor t = at::ones({4}, at::kCUDA);
      g->allreduce(t);
    } catch (const c10::Error& e) {
      error = e.what_without_backtrace();
    }
    const auto seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    done.set_value();
    peer.join();
    const bool named = error.find("allreduce") != std::string::npos && error.find("rank 0") != std::string::npos;
    std::fprintf(stderr, "after %.1f s: %s\n", seconds, error.c_str());
    std::_Exit(named && seconds < 60.0 ? 0 : 1);  // the timeout is 5 s
  };
  // (on failure, gtest prints what the scenario said: the time and the error)
  EXPECT_EXIT(scenario(), ::testing::ExitedWithCode(0), "after [0-9.]+ s: ");
}

// A CUDA model under OSS + ShardedDDP steps like torch::optim::Adam on a copy, through a freeze
// and an unfreeze of the first layer.
// A 16 -> 64 -> 4 model on CUDA (seed 0), and fp32 copies of its parameters: the recipe's masters.
std::pair<torch::nn::Sequential, std::vector<at::Tensor>> model_and_masters() {
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(16, 64), torch::nn::Linear(64, 4));
  model->to(at::kCUDA);
  std::vector<at::Tensor> master;
  for (const auto& p : model->parameters()) master.push_back(p.detach().clone().requires_grad_());
  return {model, master};
}

TEST(Cuda, OssAndShardedDdpOnCudaMatchTorchOptim) {
  SHARDOPT_NEEDS_CUDA();
  auto g = nccl_world_of_one();
  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(16, 32), torch::nn::Linear(32, 4));
  model->to(at::kCUDA);
  auto ref = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone());
  OSS oss(model->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
  ShardedDDP ddp(model.ptr(), oss);
  optim::Adam ref_opt(ref->parameters(), optim::AdamOptions(1e-2));
  for (int step = 0; step < 6; ++step) {
    const bool frozen = step >= 2 && step < 4;
    for (auto& p : model[0]->parameters()) p.requires_grad_(!frozen);
    for (auto& p : (*ref)[0]->parameters()) p.requires_grad_(!frozen);
    at::Tensor x = torch::randn({8, 16}, at::kCUDA), y = torch::randn({8, 4}, at::kCUDA);
    ddp.zero_grad(true);
    ddp.forward(x).sub(y).pow(2).mean().backward();
    oss.step();
    // fp32 CUDA parameters take kernels/'s fused AdamW/Adam kernel (a build with nvcc).
    EXPECT_TRUE(testing::Introspection::stepped_fused(oss)) << fused_step_unsupported(Introspection::local_optimizer(oss));
    ref_opt.zero_grad();
    ref->forward(x).sub(y).pow(2).mean().backward();
    ref_opt.step();
  }
  const auto mine = model->parameters(), theirs = ref->parameters();
  for (size_t i = 0; i < mine.size(); ++i) {
    EXPECT_TRUE(mine[i].is_cuda());
    EXPECT_LE(testing::rel_diff(mine[i].cpu(), theirs[i].cpu()), 1e-5) << "parameter " << i;
  }
}

// Mixed precision on CUDA: low-precision parameters and gradients, fp32 masters stepped by
// kernels/'s mixed Adam kernel (the copy written in the same pass), gradients clipped by the norm
// kernel; against the recipe on torch::optim::Adam: fp32 masters, the model's low-precision
// gradients upcast, clipped, stepped and rounded, through a freeze of the first layer.
TEST(Cuda, MixedPrecisionOnCudaFollowsTheRecipeThroughAFreezeWithClipping) {
  SHARDOPT_NEEDS_CUDA();
  for (const auto& [dtype, reduce] : {std::pair{at::kBFloat16, at::kFloat}, std::pair{at::kHalf, at::kHalf}}) {
    SCOPED_TRACE(std::string(c10::toString(dtype)) + " reduced in " + c10::toString(reduce));
    auto g = nccl_world_of_one();
    auto [model, master] = model_and_masters();
    optim::Adam ref_opt(master, optim::AdamOptions(1e-2));
    OSS oss(model->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
            OSSOptions().mixed_precision(MixedPrecision().param_dtype(dtype).reduce_dtype(reduce)));
    ShardedDDP ddp(model.ptr(), oss);
    for (const auto& p : model->parameters()) ASSERT_EQ(p.scalar_type(), dtype);
    for (int step = 0; step < 6; ++step) {
      const bool frozen = step >= 2 && step < 4;
      for (auto& p : model[0]->parameters()) p.requires_grad_(!frozen);
      const at::Tensor x = torch::randn({8, 16}, at::kCUDA), y = torch::randn({8, 4}, at::kCUDA);
      ddp.zero_grad(true);
      ddp.forward(x).to(at::kFloat).sub(y).pow(2).mean().backward();
      const double norm = oss.clip_grad_norm(0.05);
      oss.step();
      EXPECT_TRUE(testing::Introspection::stepped_fused(oss)) << "the mixed CUDA kernel steps the masters";

      // The recipe: the same low-precision copies run the batch; gradients upcast, clipped, stepped.
      std::vector<at::Tensor> low;
      for (size_t i = 0; i < master.size(); ++i) {
        low.push_back(master[i].detach().to(dtype).requires_grad_(!(frozen && i < 2)));
      }
      const at::Tensor h = at::linear(x.to(dtype), low[0], low[1]);
      at::linear(h, low[2], low[3]).to(at::kFloat).sub(y).pow(2).mean().backward();
      at::NoGradGuard no_grad;
      double squares = 0;
      for (size_t i = 0; i < master.size(); ++i) {
        master[i].mutable_grad() = low[i].grad().defined() ? low[i].grad().to(reduce).to(at::kFloat) : at::Tensor();
        if (master[i].grad().defined()) squares += master[i].grad().to(at::kDouble).pow(2).sum().item<double>();
      }
      EXPECT_NEAR(norm, std::sqrt(squares), 1e-3 * std::sqrt(squares)) << "step " << step;
      const double coef = 0.05 / (std::sqrt(squares) + 1e-6);
      for (auto& m : master) {
        if (m.grad().defined() && coef < 1) m.mutable_grad() = m.grad().to(reduce).mul_(coef).to(at::kFloat);
      }
      ref_opt.step();
      oss.consolidate_state_dict(0);
      const auto sd = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      const auto params = model->parameters();
      for (size_t i = 0; i < master.size(); ++i) {
        const at::Tensor mine = sd.at(static_cast<int64_t>(i)).toTensor();
        ASSERT_EQ(mine.scalar_type(), at::kFloat);
        EXPECT_LE(testing::rel_diff(mine.cpu(), master[i].detach().cpu()), 1e-4) << "step " << step << " master " << i;
        // The copy is the master rounded, written by the kernel.
        EXPECT_TRUE(params[i].cpu().equal(mine.cpu().to(dtype))) << "step " << step << " parameter " << i;
      }
    }
  }
}

// The gradient scaler on CUDA (Note [Unscaling in the step]): scaler.step() without unscale_()
// hands the kernels 1/scale and the found-inf flag on the device, and they skip on it. In fp32
// and with fp16 parameters and fp32 masters: every step but the overflowed one follows the
// recipe (the scaled gradients, upcast, divided by the scale, stepped by torch::optim::Adam on
// fp32 masters); the overflowed step changes no parameter and no state (4 of 5 steps counted);
// the scale halves after it and doubles after two good steps, as torch.amp.GradScaler's does.
TEST(Cuda, GradScalerOnCudaSkipsTheOverflowedStepInTheKernels) {
  SHARDOPT_NEEDS_CUDA();
  for (const c10::ScalarType dtype : {at::kFloat, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    auto g = nccl_world_of_one();
    auto [model, master] = model_and_masters();
    optim::Adam ref_opt(master, optim::AdamOptions(1e-2));
    OSSOptions options;
    if (dtype != at::kFloat) options.mixed_precision(MixedPrecision().param_dtype(dtype).reduce_dtype(at::kFloat));
    OSS oss(model->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g, options);
    ShardedDDP ddp(model.ptr(), oss);
    ShardedGradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(2));
    const std::vector<double> scales{1024, 1024, 2048, 1024, 1024};  // doubled after steps 0-1, halved by 2
    for (int step = 0; step < 5; ++step) {
      const bool overflow = step == 2;
      const double scale = scaler.get_scale();
      EXPECT_EQ(scale, scales[static_cast<size_t>(step)]) << "step " << step;
      const at::Tensor x = torch::randn({8, 16}, at::kCUDA), y = torch::randn({8, 4}, at::kCUDA);
      std::vector<at::Tensor> before;
      for (const auto& p : model->parameters()) before.push_back(p.detach().clone());
      unsigned hook = 0;
      const at::Tensor weight = model[0]->parameters()[0];
      if (overflow) {
        hook = weight.register_hook([](const at::Tensor& grad) { return at::full_like(grad, std::numeric_limits<float>::infinity()); });
      }
      ddp.zero_grad(true);
      scaler.scale(ddp.forward(x).to(at::kFloat).sub(y).pow(2).mean()).backward();
      if (overflow) weight.remove_hook(hook);
      EXPECT_EQ(scaler.step(oss), !overflow) << "step " << step;
      scaler.update();
      EXPECT_TRUE(testing::Introspection::stepped_fused(oss)) << "step " << step << ": the CUDA kernels stepped";
      const auto params = model->parameters();
      if (overflow) {
        for (size_t i = 0; i < params.size(); ++i) EXPECT_TRUE(params[i].equal(before[i])) << "parameter " << i;
        continue;
      }
      std::vector<at::Tensor> low;
      for (const auto& m : master) low.push_back(m.detach().to(dtype).requires_grad_());
      const at::Tensor h = at::linear(x.to(dtype), low[0], low[1]);
      (at::linear(h, low[2], low[3]).to(at::kFloat).sub(y).pow(2).mean() * scale).backward();
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < master.size(); ++i) master[i].mutable_grad() = low[i].grad().to(at::kFloat).div(scale);
      }
      ref_opt.step();
      oss.consolidate_state_dict(0);
      const auto sd = oss.state_dict().toGenericDict();
      for (size_t i = 0; i < master.size(); ++i) {
        const at::Tensor mine = dtype == at::kFloat ? params[i].detach()
                                                    : sd.at("master_weights").toGenericDict().at(static_cast<int64_t>(i)).toTensor();
        EXPECT_LE(testing::rel_diff(mine.cpu(), master[i].detach().cpu()), 1e-4) << "step " << step << " master " << i;
        EXPECT_TRUE(params[i].cpu().equal(mine.cpu().to(dtype))) << "step " << step << " parameter " << i;
      }
    }
    oss.consolidate_state_dict(0);
    const c10::IValue steps = oss.state_dict().toGenericDict().at("state").toGenericDict().at(int64_t{0}).toGenericDict().at("step");
    EXPECT_EQ(steps.isTensor() ? steps.toTensor().item<int64_t>() : steps.toInt(), 4) << "the overflowed step is not counted";
  }
}

// Clipping on CUDA takes the norm kernel: the L2 and inf norms of gradients of several tensors
// equal at::linalg_vector_norm's, and a NaN gradient gives a NaN norm.
TEST(Cuda, ClipGradNormOnCudaMatchesAtenAndSeesNaN) {
  SHARDOPT_NEEDS_CUDA();
  auto g = nccl_world_of_one();
  torch::manual_seed(1);
  std::vector<at::Tensor> params;
  for (int64_t n : {1000, 7, 4099, 65536}) params.push_back(torch::randn({n}, at::kCUDA).requires_grad_());
  OSS oss(params, optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
  for (const double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    for (auto& p : params) p.mutable_grad() = torch::randn_like(p) * 3;
    std::vector<at::Tensor> before;
    for (auto& p : params) before.push_back(p.grad().clone());
    const at::Tensor all = at::cat(before);
    const double expected = at::linalg_vector_norm(all.to(at::kDouble), norm_type).item<double>();
    const double total = oss.clip_grad_norm(1.0, norm_type);
    EXPECT_NEAR(total, expected, 1e-5 * expected) << "norm_type " << norm_type;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE(testing::rel_diff(params[i].grad().cpu(), (before[i] * (1.0 / (expected + 1e-6))).cpu()), 1e-5);
    }
    params[2].mutable_grad()[5] = std::numeric_limits<float>::quiet_NaN();
    EXPECT_TRUE(std::isnan(oss.clip_grad_norm(1.0, norm_type))) << "norm_type " << norm_type;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
