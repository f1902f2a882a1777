// OSS + ShardedDDP at 16, 32 and 64 ranks (threads of this process over Gloo) on a model so small
// that most ranks own a few elements or none: parity with the all-reduce reference through a
// freeze and an unfreeze, with clipping, every rank bitwise equal; then the consolidated state
// loaded at another world size takes the same next steps.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <mutex>
#include <set>
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

// 5 -> 4 -> 3: 39 elements in 4 tensors.
torch::nn::Sequential tiny_net() {
  auto made = torch::nn::Sequential(torch::nn::Linear(5, 4), torch::nn::Tanh(), torch::nn::Linear(4, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.4);
  return made;
}

optim::AdamWOptions adamw() { return optim::AdamWOptions(1e-2).weight_decay(0.01); }

TEST(ManyRanks, ParityThroughAFreezeAndACheckpointAtSixteenThirtyTwoAndSixtyFour) {
  for (int world : {16, 32, 64}) {
    std::vector<char> saved;
    Params after_save;
    std::vector<Params> ref_after;
    std::mutex mu;
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = tiny_net(), ref_net = tiny_net();
      Params params = net->parameters(), ref = ref_net->parameters();
      OSS oss(params, optimizer<optim::AdamW>(adamw()), g);
      ShardedDDP ddp(net.ptr(), oss);
      optim::AdamW ref_opt(ref, adamw());
      // 39 elements over the ranks: at 64, some ranks own nothing at all.
      std::set<int> owning;
      for (const auto& p : params) {
        for (int r : oss.owners(p)) owning.insert(r);
      }
      if (world == 64) ASSERT_LT(static_cast<int>(owning.size()), world);
      for (int step = 0; step < 6; ++step) {
        const bool frozen = step >= 2 && step < 4;  // the first layer's weight
        params[0].requires_grad_(!frozen), ref[0].requires_grad_(!frozen);
        const auto data = testing::rank_data(step, g->rank(), 1);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 1).backward();
        oss.clip_grad_norm(0.3);
        oss.step();
        ref_opt.zero_grad(true);
        testing::loss_of(ref_net->forward(data.x), data, 1).backward();
        testing::allreduce_grads(ref, *g);
        torch::nn::utils::clip_grad_norm_(ref, 0.3);
        ref_opt.step();
        ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << "world " << world << ", step " << step;
      }
      oss.consolidate_state_dict(0);
      if (g->rank() != 0) return;
      std::lock_guard<std::mutex> lock(mu);
      saved = torch::pickle_save(oss.state_dict());
      after_save = testing::clone_params(params);
      // The reference goes on alone, on the global batch of `world` samples.
      for (int step = 6; step < 8; ++step) {
        const auto data = testing::global_data(step, 0, world);
        ref_opt.zero_grad(true);
        testing::loss_of(ref_net->forward(data.x), data, world).backward();
        torch::nn::utils::clip_grad_norm_(ref, 0.3);
        ref_opt.step();
        ref_after.push_back(testing::clone_params(ref));
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
    // The state of `world` ranks goes on at a quarter of them, each with 4 of the same samples.
    run_ranks(world / 4, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = tiny_net();
      Params params = net->parameters();
      {
        at::NoGradGuard no_grad;
        for (size_t i = 0; i < params.size(); ++i) params[i].copy_(after_save[i]);
      }
      OSS oss(params, optimizer<optim::AdamW>(adamw()), g);
      ShardedDDP ddp(net.ptr(), oss);
      oss.load_state_dict(torch::pickle_load(saved));
      for (int step = 6; step < 8; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 4);
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 4).backward();
        oss.clip_grad_norm(0.3);
        oss.step();
        ASSERT_TRUE(testing::matches_reference(params, ref_after[step - 6], *g, 1e-5))
            << "from world " << world << " at world " << world / 4 << ", step " << step;
      }
    });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
