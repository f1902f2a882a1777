// Reduce scratch (Note [Reduce scratch] in csrc/ddp/reduce_scratch.cpp): a backward over many buckets
// holds the memory of at most four of them at once, keeps at most four between steps, and still
// gives the all-reduce reference's parameters, on row buckets and whole-parameter buckets.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::Introspection;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// 5 -> 24 x 9 -> 3: 20 tensors, the hidden weights 2,304 bytes each.
torch::nn::Sequential deep_net() {
  auto made = torch::nn::Sequential(torch::nn::Linear(5, 24), torch::nn::Tanh());
  for (int k = 0; k < 8; ++k) {
    made->push_back(torch::nn::Linear(24, 24));
    made->push_back(torch::nn::Tanh());
  }
  made->push_back(torch::nn::Linear(24, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

TEST(ReduceScratch, ManyBucketsReduceInFourBucketsOfScratchWithTheReferencesResult) {
  for (int world : {2, 3}) {
    for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
      SCOPED_TRACE("world " + std::to_string(world) +
                   (partition == PartitionMode::kSplit ? ", row buckets" : ", whole parameters"));
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = deep_net(), ref_net = deep_net();
        Params params = net->parameters(), ref = ref_net->parameters();
        const auto adamw = optim::AdamWOptions(1e-2).weight_decay(0.01);
        OSS oss(params, optimizer<optim::AdamW>(adamw), g, OSSOptions().partition(partition));
        // About one hidden layer per bucket.
        const int64_t cap = 2600;
        ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().reduce_bucket_bytes(cap).bucket_bytes_per_rank(0));
        optim::AdamW ref_opt(ref, adamw);
        for (int step = 0; step < 4; ++step) {
          const auto data = testing::rank_data(step, g->rank(), 1);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 1).backward();
          oss.step();
          ref_opt.zero_grad(true);
          testing::loss_of(ref_net->forward(data.x), data, 1).backward();
          testing::allreduce_grads(ref, *g);
          ref_opt.step();
          ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << "step " << step;
          // Kept between steps: at most four buckets' scratch (a row bucket's is every rank's row).
          const int64_t bucket = partition == PartitionMode::kSplit ? (cap + 64 * world) * world : cap + 64;
          EXPECT_GT(ddp.reduce_scratch_bytes(), 0);
          EXPECT_LE(ddp.reduce_scratch_bytes(), 4 * bucket) << "step " << step;
        }
        EXPECT_GE(ddp.num_buckets(), 8u);
        EXPECT_LE(Introspection::most_scratch_held(ddp), 4u);
        EXPECT_GE(Introspection::most_scratch_held(ddp), 1u);
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
