// OSS and ShardedDDP on CUDA parameters over Gloo: several ranks (threads of this process) on one
// GPU, the CUDA tensors staged through pinned host memory (Note [Staging] in
// csrc/comm/process_group.cpp). NCCL refuses two ranks on one device, so this is how the CUDA
// path runs at world sizes above 1 on a machine with one GPU. These run where a CUDA device is
// visible and are reported as skipped (not passed) everywhere else.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/mixed_precision.h>

#include "harness.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim/adam.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstring>
#include <vector>

namespace shardopt {
namespace {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

#define SHARDOPT_NEEDS_CUDA() \
  if (!at::globalContext().hasCUDA()) GTEST_SKIP() << "no CUDA device visible: not run"

// 12 -> 16 -> 3, the same initial values on every rank.
torch::nn::Sequential small_net() {
  auto made = torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::Tanh(), torch::nn::Linear(16, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

// Rank r's batch at step `step`: 4 rows of its own.
std::pair<at::Tensor, at::Tensor> batch(int step, int rank) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  return {at::randn({4, 12}, gen), at::randn({4, 3}, gen)};
}

Params cpu(const Params& params) {
  Params out;
  for (const auto& p : params) out.push_back(p.detach().cpu());
  return out;
}

optim::AdamOptions adam() { return optim::AdamOptions(1e-2); }

// World 2 and 3 on one GPU, each rank's data its own: parameters follow torch::optim::Adam on the
// CPU stepping the mean of every rank's gradients, through a freeze and an unfreeze of the first
// layer with clipping, every rank bitwise equal.
TEST(CudaOverGloo, ParityAtWorldTwoAndThreeThroughAFreezeWithClipping) {
  SHARDOPT_NEEDS_CUDA();
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = small_net(), ref_net = small_net();
      net->to(at::kCUDA);
      OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), g);
      ShardedDDP ddp(net.ptr(), oss);
      Params ref = ref_net->parameters();
      optim::Adam ref_opt(ref, adam());
      for (int step = 0; step < 6; ++step) {
        const bool frozen = step >= 2 && step < 4;
        for (auto& p : net[0]->parameters()) p.requires_grad_(!frozen);
        for (auto& p : ref_net[0]->parameters()) p.requires_grad_(!frozen);
        const auto [x, y] = batch(step, g->rank());
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(x, *g));
        ddp.zero_grad(true);
        ddp.forward(x.cuda()).sub(y.cuda()).pow(2).mean().backward();
        oss.clip_grad_norm(0.5);
        oss.step();
        // The reference: every rank's batch on the CPU, the gradients averaged, clipped, stepped.
        ref_opt.zero_grad(true);
        for (int r = 0; r < world; ++r) {
          const auto [rx, ry] = batch(step, r);
          ref_net->forward(rx).sub(ry).pow(2).mean().div(world).backward();
        }
        torch::nn::utils::clip_grad_norm_(ref, 0.5);
        ref_opt.step();
        for (const auto& p : net->parameters()) ASSERT_TRUE(p.is_cuda());
        ASSERT_TRUE(testing::matches_reference(cpu(net->parameters()), ref, *g, 1e-5)) << "step " << step;
      }
    });
  }
}

// bf16 parameters and gradients on the GPU, fp32 masters and Adam state sharded, gradients reduced
// in fp32: the masters follow torch::optim::Adam on fp32 masters stepping the mean of every rank's
// bf16 gradients, upcast, through a freeze; each parameter is its master rounded.
TEST(CudaOverGloo, MixedPrecisionFollowsFp32MastersAtWorldTwo) {
  SHARDOPT_NEEDS_CUDA();
  const int world = 2;
  run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = small_net();
    Params master;
    for (const auto& p : net->parameters()) master.push_back(p.detach().clone().requires_grad_());
    optim::Adam ref_opt(master, adam());
    net->to(at::kCUDA);
    OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), g,
            OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16).reduce_dtype(at::kFloat)));
    ShardedDDP ddp(net.ptr(), oss);
    for (int step = 0; step < 5; ++step) {
      const bool frozen = step == 2;
      for (auto& p : net[0]->parameters()) p.requires_grad_(!frozen);
      const auto [x, y] = batch(step, g->rank());
      ddp.zero_grad(true);
      ddp.forward(x.cuda()).to(at::kFloat).sub(y.cuda()).pow(2).mean().backward();
      oss.step();
      // The recipe: each rank's batch through bf16 copies of the masters, gradients upcast and
      // averaged, Adam on the fp32 masters.
      ref_opt.zero_grad(true);
      for (int r = 0; r < world; ++r) {
        Params low;
        for (size_t i = 0; i < master.size(); ++i) {
          low.push_back(master[i].detach().to(at::kBFloat16).requires_grad_(!(frozen && i < 2)));
        }
        const auto [rx, ry] = batch(step, r);
        const at::Tensor h = at::tanh(at::linear(rx.to(at::kBFloat16), low[0], low[1]));
        at::linear(h, low[2], low[3]).to(at::kFloat).sub(ry).pow(2).mean().backward();
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < master.size(); ++i) {
          if (!low[i].grad().defined()) continue;
          const at::Tensor g32 = low[i].grad().to(at::kFloat).div(world);
          master[i].mutable_grad() = master[i].grad().defined() ? master[i].grad() + g32 : g32;
        }
      }
      ref_opt.step();
      oss.consolidate_state_dict(0);
      if (g->rank() != 0) continue;
      const auto sd = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      const Params params = net->parameters();
      for (size_t i = 0; i < master.size(); ++i) {
        const at::Tensor mine = sd.at(static_cast<int64_t>(i)).toTensor().cpu();
        EXPECT_LE(testing::rel_diff(mine, master[i].detach()), 1e-3) << "step " << step << " master " << i;
        EXPECT_TRUE(params[i].cpu().equal(mine.to(at::kBFloat16))) << "step " << step << " parameter " << i;
      }
    }
  });
}

// Saved after 4 steps (the consolidated state and the parameters), loaded into a new model and
// OSS, 2 more steps: bit for bit the parameters of the run that went on.
TEST(CudaOverGloo, ResumesBitExactAtWorldThree) {
  SHARDOPT_NEEDS_CUDA();
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    auto train = [&](torch::nn::Sequential& net, ShardedDDP& ddp, OSS& oss, int step) {
      const auto [x, y] = batch(step, g->rank());
      for (auto& p : net[0]->parameters()) p.requires_grad_(step != 1);
      ddp.zero_grad(true);
      ddp.forward(x.cuda()).sub(y.cuda()).pow(2).mean().backward();
      oss.step();
    };
    auto net = small_net();
    net->to(at::kCUDA);
    OSS oss(net->parameters(), optimizer<optim::Adam>(adam()), g);
    ShardedDDP ddp(net.ptr(), oss);
    for (int step = 0; step < 4; ++step) train(net, ddp, oss, step);
    oss.consolidate_state_dict(0);
    std::vector<char> saved = g->rank() == 0 ? torch::pickle_save(oss.state_dict()) : std::vector<char>{};
    // Every rank loads rank 0's bytes, as from a checkpoint file.
    at::Tensor size = at::tensor({static_cast<int64_t>(saved.size())}, at::kLong);
    g->broadcast(size, 0);
    at::Tensor bytes = at::zeros({size.item<int64_t>()}, at::kByte);
    if (g->rank() == 0) std::memcpy(bytes.data_ptr(), saved.data(), saved.size());
    g->broadcast(bytes, 0);
    const Params at_save = cpu(net->parameters());
    for (int step = 4; step < 6; ++step) train(net, ddp, oss, step);

    auto resumed = small_net();
    {
      at::NoGradGuard no_grad;
      const Params ps = resumed->parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(at_save[i]);
    }
    resumed->to(at::kCUDA);
    OSS oss2(resumed->parameters(), optimizer<optim::Adam>(adam()), g);
    ShardedDDP ddp2(resumed.ptr(), oss2);
    oss2.load_state_dict(torch::pickle_load(std::vector<char>(static_cast<char*>(bytes.data_ptr()),
                                                              static_cast<char*>(bytes.data_ptr()) + bytes.numel())));
    for (int step = 4; step < 6; ++step) train(resumed, ddp2, oss2, step);
    const Params a = cpu(net->parameters()), b = cpu(resumed->parameters());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << "parameter " << i;
  });
}

}  // namespace
}  // namespace shardopt
