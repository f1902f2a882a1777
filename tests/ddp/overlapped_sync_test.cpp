// ShardedDDPOptions::overlap_param_sync: the parameter sync after the step runs beside the next
// forward. Every forward sees the reference's parameters (plain torch::optim::Adam on
// all-reduced gradients), through freezes that lay the buffers out while the sync is in flight,
// and a checkpoint saved with the sync in flight resumes bit-exactly.
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <cstdio>
#include <unistd.h>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

torch::nn::Sequential make_sequential() {
  auto net = torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh(), torch::nn::Linear(16, 16),
                                   torch::nn::Tanh(), torch::nn::Linear(16, 3));
  testing::fill_seeded(net->parameters(), 1);
  return net;
}

OptimizerFactory adam() { return optimizer<optim::Adam>(optim::AdamOptions(1e-2)); }

// One reference step: this rank's loss, gradients averaged over the group, Adam.
void reference_step(torch::nn::Sequential& ref, optim::Adam& opt, const testing::Data& data, ProcessGroup& g) {
  opt.zero_grad(true);
  testing::loss_of(ref->forward(data.x), data, 3).backward();
  Params ps = ref->parameters();
  for (auto& p : ps) {
    if (!p.requires_grad()) p.mutable_grad().reset();
  }
  testing::allreduce_grads(ps, g);
  opt.step();
}

void freeze_middle(torch::nn::Sequential& net, bool frozen) {
  for (auto& p : net[2]->parameters()) p.requires_grad_(!frozen);
}

TEST(OverlappedParamSync, SequentialForwardSeesTheReferencesParametersThroughFreezes) {
  for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE("world " + std::to_string(world) + (partition == PartitionMode::kSplit ? ", split" : ", whole"));
      testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = make_sequential(), ref = make_sequential();
        optim::Adam ref_opt(ref->parameters(), optim::AdamOptions(1e-2));
        OSS oss(net->parameters(), adam(), g, OSSOptions().partition(partition));
        ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().reduce_bucket_bytes(256).overlap_param_sync(true));
        // The ranks' threads share the global generator: the reference starts from the values
        // ShardedDDP synced at start-up (rank 0's).
        {
          at::NoGradGuard no_grad;
          auto mine = net->parameters(), theirs = ref->parameters();
          for (size_t i = 0; i < mine.size(); ++i) theirs[i].copy_(mine[i]);
        }
        for (int step = 0; step < 6; ++step) {
          const bool frozen = step == 2 || step == 3;
          freeze_middle(net, frozen);  // a new layout while the last sync may be in flight
          freeze_middle(ref, frozen);
          const auto data = testing::rank_data(step, g->rank(), 3);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          ddp.zero_grad();
          at::Tensor out = ddp.forward(data.x);
          // Every child waited for its parameters: they are the reference's after the last step.
          ASSERT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5)) << "step " << step;
          testing::loss_of(out, data, 3).backward();
          oss.step();
          EXPECT_TRUE(testing::Introspection::param_sync_in_flight(oss)) << "the sync is left to the next forward";
          reference_step(ref, ref_opt, data, *g);
        }
        ddp.finish_param_sync();
        EXPECT_FALSE(testing::Introspection::param_sync_in_flight(oss));
        EXPECT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5));
      });
    }
  }
}

TEST(OverlappedParamSync, OtherModulesFinishInPreForward) {
  testing::run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<testing::NamedNet>();
    Params ref = testing::clone_params(net->params);
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64).overlap_param_sync(true));
    for (int step = 0; step < 4; ++step) {
      const auto data = testing::rank_data(step, g->rank(), 3);
      ddp.zero_grad();
      at::Tensor out = ddp.forward(data.x);
      EXPECT_FALSE(testing::Introspection::param_sync_in_flight(oss));
      ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5)) << "step " << step;
      testing::loss_of(out, data, 3).backward();
      oss.step();
      ref_opt.zero_grad(true);
      testing::loss(ref, data, 3).backward();
      testing::allreduce_grads(ref, *g);
      ref_opt.step();
    }
  });
}

TEST(OverlappedParamSync, ACheckpointSavedWithTheSyncInFlightResumesBitExactly) {
  char dir_template[] = "/tmp/shardopt-overlap-XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  const std::string path = dir + "/run.ckpt";
  Params straight, resumed;
  auto train = [](torch::nn::Sequential& net, ShardedDDP& ddp, OSS& oss, ProcessGroup& g, int from, int to) {
    for (int step = from; step < to; ++step) {
      const auto data = testing::rank_data(step, g.rank(), 3);
      ddp.zero_grad();
      testing::loss_of(ddp.forward(data.x), data, 3).backward();
      oss.step();
    }
  };
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = make_sequential();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().overlap_param_sync(true));
    train(net, ddp, oss, *g, 0, 3);
    save_checkpoint(path, *net, oss, TrainingState{});
    train(net, ddp, oss, *g, 3, 5);
    ddp.finish_param_sync();
    if (g->rank() == 0) straight = testing::clone_params(net->parameters());
  });
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = make_sequential();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().overlap_param_sync(true));
    load_checkpoint(path, *net, oss);
    train(net, ddp, oss, *g, 3, 5);
    ddp.finish_param_sync();
    if (g->rank() == 0) resumed = testing::clone_params(net->parameters());
  });
  ASSERT_EQ(straight.size(), resumed.size());
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_TRUE(straight[i].equal(resumed[i])) << "parameter " << i;
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

// Once the ShardedDDP is gone, OSS goes on alone as if it had never had one: its step syncs in
// full again, and checks the trainable set itself, so a freeze lays the buffers out anew.
TEST(OverlappedParamSync, OssGoesOnAloneOnceTheShardedDdpIsGone) {
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = make_sequential(), ref = make_sequential();
    optim::Adam ref_opt(ref->parameters(), optim::AdamOptions(1e-2));
    OSS oss(net->parameters(), adam(), g, OSSOptions().partition(PartitionMode::kSplit));
    {
      ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().overlap_param_sync(true));
      {
        at::NoGradGuard no_grad;
        auto mine = net->parameters(), theirs = ref->parameters();
        for (size_t i = 0; i < mine.size(); ++i) theirs[i].copy_(mine[i]);
      }
      for (int step = 0; step < 2; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.step();
        reference_step(ref, ref_opt, data, *g);
      }
    }
    EXPECT_FALSE(testing::Introspection::param_sync_in_flight(oss)) << "the ShardedDDP finished its sync";
    for (int step = 2; step < 5; ++step) {
      freeze_middle(net, step >= 3);
      freeze_middle(ref, step >= 3);
      const auto data = testing::rank_data(step, g->rank(), 3);
      oss.zero_grad();
      testing::loss_of(net->forward(data.x), data, 3).backward();
      Params grads;
      for (auto& p : net->parameters()) {
        if (p.requires_grad()) grads.push_back(p);
      }
      testing::allreduce_grads(grads, *g);
      const int64_t layouts = testing::Introspection::layout_version(oss);
      oss.step();
      EXPECT_EQ(testing::Introspection::layout_version(oss) > layouts, step == 3)
          << "step " << step << ": the step lays out for the frozen set, once";
      EXPECT_FALSE(testing::Introspection::param_sync_in_flight(oss)) << "step " << step;
      reference_step(ref, ref_opt, data, *g);
      ASSERT_TRUE(testing::matches_reference(net->parameters(), ref->parameters(), *g, 1e-5)) << "step " << step;
    }
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
