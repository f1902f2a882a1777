#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"
#include "parity.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/module.h>
#include <torch/csrc/api/include/torch/nn/utils/clip_grad.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/autograd/custom_function.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using testing::run_ranks_collect_errors;
using Params = std::vector<at::Tensor>;

// The test model as a module: parameters w1, b1, w2, b2, s and one buffer.
struct TinyNet : torch::nn::Module {
  TinyNet() {
    auto p = testing::make_params();
    const char* names[] = {"w1", "b1", "w2", "b2", "s"};
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter(names[i], p[i]));
    stat = register_buffer("stat", at::zeros({2}));
  }
  // Two inputs: the second decides whether the last parameter takes part.
  at::Tensor forward(at::Tensor x, bool use_scale) { return testing::output(params, x, use_scale); }
  Params params;
  at::Tensor stat;
};

struct DdpParity {
  int world = 2;
  int steps = 7;
  int per_rank = 4;
  int64_t bucket_bytes = 0;
  int64_t align = 1;  // elements; every parameter starts at a multiple of it in the flat layout
  PartitionMode partition = PartitionMode::kAuto;
  ParamSync sync = ParamSync::kBroadcast;
  bool overlap_sync = false;
  bool accumulate = false;
  bool change_trainability = false;
  bool clip = false;
  bool skip_scale_on_odd_steps = false;
  int skip_scale_on_rank = -1;  // this rank alone leaves the last parameter unused on odd steps
  bool two_optimizers = false;
  OptimizerFactory factory = optimizer<optim::Adam>(optim::AdamOptions(1e-2));
  // Replaces change_trainability's pattern: sets requires_grad on both models before a step.
  std::function<void(int step, Params& mine, Params& ref)> trainability;
  // Runs once the optimizers exist, before the ShardedDDP is made (a freeze in between, ...).
  std::function<void(Params& mine, Params& ref)> before_ddp;
  // Runs after each step's backward (before the optimizer step), and after the step.
  std::function<void(int step, ShardedDDP& ddp, OSS& oss, ProcessGroup& g)> after_backward, after_step;

  std::string name() const {
    return "world " + std::to_string(world) + " buckets " + std::to_string(bucket_bytes) + " accumulate " +
           std::to_string(accumulate) + " trainability " + std::to_string(change_trainability) + " clip " +
           std::to_string(clip) + " align " + std::to_string(align) + " two optimizers " +
           std::to_string(two_optimizers);
  }

  void run() const {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<TinyNet>();
      Params ref = testing::clone_params(net->params);
      auto ref_opt = factory({optim::OptimizerParamGroup(ref)});
      std::unique_ptr<OSS> oss_a, oss_b;
      std::vector<OSS*> opts;
      const auto oss_options = OSSOptions().layout(LayoutOptions().align(align)).partition(partition).sync(sync);
      if (two_optimizers) {
        oss_a = std::make_unique<OSS>(Params{net->params[0], net->params[1]}, factory, g, oss_options);
        oss_b = std::make_unique<OSS>(Params{net->params[2], net->params[3], net->params[4]}, factory, g, oss_options);
        opts = {oss_a.get(), oss_b.get()};
      } else {
        oss_a = std::make_unique<OSS>(net->parameters(), factory, g, oss_options);
        opts = {oss_a.get()};
      }
      if (before_ddp) before_ddp(net->params, ref);
      ShardedDDP ddp(net, opts, ShardedDDPOptions().reduce_bucket_bytes(bucket_bytes).overlap_param_sync(overlap_sync));
      if (change_trainability) {
        net->params[0].requires_grad_(false);
        ref[0].requires_grad_(false);
      }
      const int micro = accumulate ? 2 : 1;
      for (int step = 0; step < steps; ++step) {
        if (trainability) trainability(step, net->params, ref);
        if (change_trainability) {
          if (step == 2) net->params[0].requires_grad_(true), ref[0].requires_grad_(true);
          const bool layer_frozen = step >= 4 && step < 6;
          for (int i : {2, 3}) net->params[i].requires_grad_(!layer_frozen), ref[i].requires_grad_(!layer_frozen);
        }
        const bool use_scale = !(skip_scale_on_odd_steps && step % 2 == 1) &&
                               !(step % 2 == 1 && g->rank() == skip_scale_on_rank);
        ref_opt->zero_grad(true);
        ddp.zero_grad(true);
        for (int m = 0; m < micro; ++m) {
          auto data = testing::rank_data(step * micro + m, g->rank(), per_rank);
          if (step == 0 && m == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << "data must differ";
          testing::loss(ref, data, per_rank, use_scale).backward();
          at::Tensor out = ddp.forward(data.x, use_scale);
          if (m + 1 < micro) {
            auto guard = ddp.no_sync();
            testing::loss_of(out, data, per_rank).backward();
          } else {
            testing::loss_of(out, data, per_rank).backward();
          }
        }
        if (skip_scale_on_rank >= 0) {
          // DDP's find_unused_parameters: a rank without a parameter's gradient adds zeros to the
          // mean of the ranks that have one.
          for (auto& p : ref) {
            if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
          }
        }
        testing::allreduce_grads(ref, *g);
        // After backward a rank holds gradients only for parameters it owns.
        for (size_t i = 0; i < ref.size(); ++i) {
          if (opts.size() == 1 && oss_a->owner(net->params[i]) != g->rank()) {
            ASSERT_FALSE(net->params[i].grad().defined()) << "non-owner kept the gradient of parameter " << i;
          }
        }
        if (clip) {
          Params with_grad;
          for (auto& p : ref) if (p.requires_grad() && p.grad().defined()) with_grad.push_back(p);
          double expected = torch::nn::utils::clip_grad_norm_(with_grad, 0.5);
          ASSERT_EQ(opts.size(), 1u);
          double got = oss_a->clip_grad_norm(0.5);
          ASSERT_NEAR(got, expected, 1e-5 * std::max(1.0, expected)) << "clip norm at step " << step << ", " << name();
        }
        if (after_backward) after_backward(step, ddp, *oss_a, *g);
        ref_opt->step();
        for (OSS* o : opts) o->step();
        if (overlap_sync) ddp.finish_param_sync();
        for (size_t i = 0; i < ref.size(); ++i) {
          ASSERT_LE(testing::rel_diff(net->params[i], ref[i]), 1e-5) << "parameter " << i << " after step " << step << ", " << name();
        }
        ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g)) << "ranks diverged after step " << step;
        if (after_step) after_step(step, ddp, *oss_a, *g);
      }
      if (change_trainability) EXPECT_GE(ddp.rebuild_count(), 4);
    });
  }
};

// Freezing w1 and w2 (82% of the model) leaves one rank with all the trainable work. The forward
// after the first step with the new set re-partitions (the set is agreed on by then), the buckets
// follow the new owners, each rank then holds only its balanced share of the gradients, and the
// frozen tensors' kept state is spread with it (Note [Kept state]), so that unfreezing finds the
// work balanced without a second re-partition; parity with the reference holds throughout.
TEST(ShardedDDP, FreezingRebalancesOwnersAndBuckets) {
  for (int world : {2, 3}) {
    for (int64_t bucket_bytes : {int64_t{0}, int64_t{160}}) {
      DdpParity p;
      p.world = world;
      p.steps = 9;
      p.bucket_bytes = bucket_bytes;
      p.partition = PartitionMode::kWholeParameters;  // re-partitioning moves whole parameters
      p.trainability = [](int step, Params& mine, Params& ref) {
        for (Params* q : {&mine, &ref}) {
          for (int i : {0, 2}) (*q)[i].requires_grad_(!(step >= 2 && step < 6));
        }
      };
      p.after_backward = [](int step, ShardedDDP& ddp, OSS& oss, ProcessGroup& g) {
        if (step < 7) ASSERT_EQ(Introspection::partition_version(oss), step < 3 ? 0 : 1) << "step " << step;
        if (step >= 7) {  // unfrozen: re-partitioned again, or balanced already by the spread kept state
          std::vector<int64_t> weights;
          for (const auto& q : Introspection::all_params(oss)) weights.push_back(q.numel() * 4);
          const std::vector<uint8_t> all(weights.size(), 1);
          EXPECT_NEAR(Introspection::partition(oss).imbalance(weights, all), Partition::balance(weights, g.size()).imbalance(), 1e-12)
              << "step " << step << ": as balanced as whole tensors allow";
        }
        if (step < 3 || step >= 6) return;
        // Frozen: b1, b2 and s are trainable; their gradients are split as evenly as tensors allow.
        std::vector<int64_t> weights;
        std::vector<uint8_t> mask;
        int64_t trainable_bytes = 0;
        for (const auto& q : Introspection::all_params(oss)) {
          weights.push_back(q.numel() * 4);
          mask.push_back(q.requires_grad());
          if (q.requires_grad()) trainable_bytes += q.numel() * 4;
        }
        const double best = Partition::balance(weights, g.size(), mask).imbalance();
        EXPECT_NEAR(Introspection::partition(oss).imbalance(weights, mask), best, 1e-12);
        EXPECT_LE(ddp.local_grad_bytes(), trainable_bytes * (1 + best) / g.size() + 1e-9) << "step " << step;
      };
      SCOPED_TRACE("world " + std::to_string(world) + " buckets " + std::to_string(bucket_bytes));
      p.run();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

// A freeze between making the optimizer and making the ShardedDDP: the partition was decided for
// every parameter, so the first forward re-partitions for the set the ShardedDDP was made with,
// each rank then holds its balanced share, and parity with the reference holds.
TEST(ShardedDDP, AFreezeBeforeItIsMadeIsBalancedAtTheFirstForward) {
  for (int world : {2, 3}) {
    DdpParity p;
    p.world = world;
    p.steps = 4;
    p.partition = PartitionMode::kWholeParameters;
    p.before_ddp = [](Params& mine, Params& ref) {
      for (Params* q : {&mine, &ref}) (*q)[0].requires_grad_(false), (*q)[2].requires_grad_(false);
    };
    p.after_backward = [](int step, ShardedDDP&, OSS& oss, ProcessGroup& g) {
      ASSERT_EQ(Introspection::partition_version(oss), 1) << "step " << step;
      std::vector<int64_t> weights;
      std::vector<uint8_t> mask;
      for (const auto& q : Introspection::all_params(oss)) weights.push_back(q.numel() * 4), mask.push_back(q.requires_grad());
      EXPECT_NEAR(Introspection::partition(oss).imbalance(weights, mask), Partition::balance(weights, g.size(), mask).imbalance(),
                  1e-12)
          << "step " << step;
    };
    SCOPED_TRACE("world " + std::to_string(world));
    p.run();
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(ShardedDDP, ParityMatrix) {
  for (int world : {2, 3}) {
    for (int64_t bucket_bytes : {int64_t{0}, int64_t{160}}) {
      for (bool accumulate : {false, true}) {
        for (bool trainability : {false, true}) {
          for (bool clip : {false, true}) {
            for (int opt = 0; opt < 2; ++opt) {
              DdpParity p;
              p.world = world;
              p.bucket_bytes = bucket_bytes;
              p.accumulate = accumulate;
              p.change_trainability = trainability;
              p.clip = clip;
              if (opt == 1) p.factory = optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9));
              SCOPED_TRACE(p.name() + (opt ? " SGD" : " Adam"));
              p.run();
              if (::testing::Test::HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

// ParamSync::kAllgather: the parameter sync is one all-gather of the shards as rows per flat
// buffer (Note [Rows]), after the step or beside the next forward, whole or split, through
// freezes and unfreezes: parity with the reference, every rank bitwise equal, and one collective
// per step (TinyNet has one flat buffer) at every world size, with no broadcast.
TEST(ShardedDDP, AllGatherSyncIsOneCollectiveAndMatchesTheReferenceThroughFreezes) {
  for (int world : {2, 3, 4}) {
    for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
      for (bool overlap : {false, true}) {
        DdpParity p;
        p.world = world;
        p.partition = partition;
        p.sync = ParamSync::kAllgather;
        p.overlap_sync = overlap;
        p.bucket_bytes = 160;
        p.change_trainability = true;
        p.after_backward = [](int, ShardedDDP&, OSS&, ProcessGroup& g) { g.reset_stats(); };
        p.after_step = [](int step, ShardedDDP&, OSS&, ProcessGroup& g) {
          // (the check that every rank's parameters are equal is the other all-gather)
          EXPECT_EQ(g.stats().calls[CommStats::kAllgather], 1 + 1) << "step " << step;
          EXPECT_EQ(g.stats().calls[CommStats::kBroadcast], 0) << "step " << step;
        };
        SCOPED_TRACE(p.name() + (partition == PartitionMode::kSplit ? " split" : " whole") +
                     (overlap ? " overlapped" : ""));
        p.run();
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(ShardedDDP, ParitySubsetAtWorldFour) {
  DdpParity p;
  p.world = 4;
  p.bucket_bytes = 160;
  p.accumulate = true;
  p.change_trainability = true;
  p.run();
}

TEST(ShardedDDP, ParameterWithoutGradientInSomeStepsAndTwoOptimizers) {
  DdpParity p;
  p.world = 3;
  p.bucket_bytes = 1 << 20;
  p.skip_scale_on_odd_steps = true;
  p.two_optimizers = true;
  p.run();
}

// A parameter one rank leaves unused while the others use it (odd steps; DDP's
// find_unused_parameters case): that rank still launches every bucket and feeds the parameter's
// rows zeros, so the owner steps the mean over all ranks, as DDP does, and every rank issues the
// same collectives. Row buckets, whole parameters and the default partition, worlds 2, 3 and 4.
TEST(ShardedDDP, ParameterUnusedOnOneRankIsAveragedWithItsZeros) {
  for (int world : {2, 3, 4}) {
    for (PartitionMode partition : {PartitionMode::kAuto, PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
      SCOPED_TRACE("world " + std::to_string(world) + ", partition " + std::to_string(static_cast<int>(partition)));
      DdpParity p;
      p.world = world;
      p.partition = partition;
      p.skip_scale_on_rank = world - 1;
      p.after_backward = [](int step, ShardedDDP&, OSS&, ProcessGroup& g) {
        at::Tensor calls = at::full({2}, g.stats().total_calls(), at::kLong);
        calls[1].neg_();
        g.allreduce(calls, Reduction::kMax);
        EXPECT_EQ(calls[0].item<int64_t>(), -calls[1].item<int64_t>()) << "collectives differ at step " << step;
      };
      p.run();
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(ShardedDDP, GlobalSamplesScalingEqualsSingleProcessOnRealSamples) {
  // Rank 0 has 4 real samples, rank 1 has 2 real samples and 2 padding entries.
  const std::vector<std::vector<uint8_t>> real = {{1, 1, 1, 1}, {1, 0, 1, 0}};
  const int total_real = 6;
  Params expected = testing::make_params();
  {
    optim::SGD opt(expected, optim::SGDOptions(0.1).momentum(0.9));
    for (int step = 0; step < 4; ++step) {
      opt.zero_grad();
      std::vector<at::Tensor> xs, ys;
      for (int r = 0; r < 2; ++r) {
        auto d = testing::rank_data(step, r, 4);
        for (int i = 0; i < 4; ++i) {
          if (real[r][i]) xs.push_back(d.x[i].unsqueeze(0)), ys.push_back(d.y[i].unsqueeze(0));
        }
      }
      testing::loss(expected, {at::cat(xs), at::cat(ys)}, total_real).backward();
      opt.step();
    }
  }
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TinyNet>();
    OSS oss(net->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1).momentum(0.9)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().grad_scaling(GradScaling::kGlobalSamples).reduce_bucket_bytes(64));
    for (int step = 0; step < 4; ++step) {
      ddp.zero_grad(true);
      auto d = testing::rank_data(step, g->rank(), 4);
      at::Tensor mask = at::tensor(std::vector<float>(real[g->rank()].begin(), real[g->rank()].end())).unsqueeze(1);
      ddp.set_global_samples(total_real);
      at::Tensor out = ddp.forward(d.x, true);
      ((out - d.y).pow(2) * mask).sum().backward();  // each rank's loss: the sum over its real samples
      oss.step();
    }
    for (size_t i = 0; i < expected.size(); ++i) EXPECT_LE(testing::rel_diff(net->params[i], expected[i]), 1e-5) << i;
  });
}

// Two micro-batches per step with kGlobalSamples, accumulated either under no_sync() (one
// reduction, divided by the real samples of both) or by two synchronised backward passes without
// clearing (each divided by its own count and added, as two DDP backward passes would be), with
// parameters held whole and split. Micro-batch 0 has 6 real samples over the ranks, micro-batch 1
// has 8, so the two ways give different results and each is checked against its own reference.
TEST(ShardedDDP, GlobalSamplesWithAccumulationEqualsSingleProcess) {
  const std::vector<std::vector<std::vector<uint8_t>>> real = {{{1, 1, 1, 1}, {1, 0, 1, 0}},
                                                               {{1, 1, 1, 1}, {1, 1, 1, 1}}};
  const int counts[] = {6, 8};
  for (bool under_no_sync : {true, false}) {
    Params expected = testing::make_params();
    {
      optim::SGD opt(expected, optim::SGDOptions(0.1).momentum(0.9));
      for (int step = 0; step < 3; ++step) {
        opt.zero_grad();
        for (int m = 0; m < 2; ++m) {
          std::vector<at::Tensor> xs, ys;
          for (int r = 0; r < 2; ++r) {
            auto d = testing::rank_data(step * 2 + m, r, 4);
            for (int i = 0; i < 4; ++i) {
              if (real[m][r][i]) xs.push_back(d.x[i].unsqueeze(0)), ys.push_back(d.y[i].unsqueeze(0));
            }
          }
          const double divisor = under_no_sync ? counts[0] + counts[1] : counts[m];
          testing::loss(expected, {at::cat(xs), at::cat(ys)}, divisor).backward();
        }
        opt.step();
      }
    }
    for (auto partition : {PartitionMode::kWholeParameters, PartitionMode::kSplit}) {
      run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<TinyNet>();
        OSS oss(net->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1).momentum(0.9)), g,
                OSSOptions().partition(partition));
        ShardedDDP ddp(net, oss, ShardedDDPOptions().grad_scaling(GradScaling::kGlobalSamples).reduce_bucket_bytes(64));
        for (int step = 0; step < 3; ++step) {
          ddp.zero_grad(true);
          for (int m = 0; m < 2; ++m) {
            auto d = testing::rank_data(step * 2 + m, g->rank(), 4);
            const auto& mine = real[m][g->rank()];
            at::Tensor mask = at::tensor(std::vector<float>(mine.begin(), mine.end())).unsqueeze(1);
            at::Tensor out = ddp.forward(d.x, true);
            at::Tensor loss = ((out - d.y).pow(2) * mask).sum();
            if (under_no_sync && m == 0) {
              auto guard = ddp.no_sync();
              loss.backward();
            } else {
              ddp.set_global_samples(under_no_sync ? counts[0] + counts[1] : counts[m]);
              loss.backward();
            }
          }
          oss.step();
        }
        for (size_t i = 0; i < expected.size(); ++i) {
          EXPECT_LE(testing::rel_diff(net->params[i], expected[i]), 1e-5)
              << "parameter " << i << (under_no_sync ? ", under no_sync" : ", without clearing") << ", partition "
              << static_cast<int>(partition);
        }
      });
    }
  }
}

// A model of 8 equal tensors: each rank ends a backward with only its own gradients.
struct Wide : torch::nn::Module {
  Wide() {
    for (int i = 0; i < 8; ++i) {
      ps.push_back(register_parameter("p" + std::to_string(i), testing::seeded_randn({1000}, i) * 0.1));
    }
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor acc = at::zeros({});
    for (auto& p : ps) acc = acc + (p * x).sum();
    return acc;
  }
  Params ps;
};

TEST(ShardedDDP, GradientMemoryAndCommunicationVolume) {
  for (PartitionMode mode : {PartitionMode::kAuto, PartitionMode::kWholeParameters}) {
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Wide>();
      OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g, OSSOptions().partition(mode));
      const int64_t cap = 8000;  // two parameters per bucket
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(cap).bucket_bytes_per_rank(0));
      ASSERT_EQ(Introspection::split(oss), mode == PartitionMode::kAuto);
      ASSERT_EQ(ddp.num_buckets(), 4u);  // two parameters each
      const int64_t total = 8 * 1000 * 4;
      g->reset_stats();
      at::Tensor x = testing::seeded_randn({1000}, 10 + g->rank());
      ddp.forward(x).backward();
      const int64_t mine = ddp.local_grad_bytes();
      EXPECT_GT(mine, 0);
      EXPECT_LE(mine, total / 2 * (1 + Introspection::partition(oss).imbalance()) + cap) << "gradient bytes on rank " << g->rank();
      // One step moves each gradient once (reduced to its owner, or reduce-scattered to the
      // owners of its row bucket) and each parameter once (broadcast from its owner, or
      // all-gathered from the rows' owners): the 2 x parameter bytes of plain data parallel,
      // plus one flag per parameter (row buckets: one per parameter piece in each row).
      const auto& stats = g->stats();
      const auto reduced = stats.bytes[mode == PartitionMode::kAuto ? CommStats::kReduceScatter : CommStats::kReduce];
      EXPECT_EQ(reduced, total + 8 * 4);
      oss.step();
      const auto synced = stats.bytes[mode == PartitionMode::kAuto ? CommStats::kAllgather : CommStats::kBroadcast];
      EXPECT_EQ(synced, total) << "balanced shards need no padding here";
      EXPECT_LE(reduced + synced, 2 * total + 8 * 4);
      EXPECT_EQ(stats.calls[CommStats::kReduce] + stats.calls[CommStats::kBroadcast] == 0,
                mode == PartitionMode::kAuto);
    });
  }
}

TEST(ShardedDDP, RanksWithDifferentTrainableSetsFailOnEveryRank) {
  auto errors = run_ranks_collect_errors(
      3,
      [](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<TinyNet>();
        OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
        ShardedDDP ddp(net, oss);
        if (g->rank() == 2) net->params[3].requires_grad_(false);
        // The check started by forward() is settled before backward's first reduction.
        ddp.forward(at::ones({2, 5}), true).sum().backward();
      },
      std::chrono::seconds(20));
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("parameter 'b2'"), std::string::npos) << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("on rank 2"), std::string::npos) << errors[r];
  }
}

TEST(ShardedDDP, RefreshWhileNoSyncGradientsWaitIsAnError) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TinyNet>();
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().auto_refresh_trainable(false));
    {
      auto guard = ddp.no_sync();
      ddp.forward(at::ones({2, 5}), true).sum().backward();
    }
    net->params[0].requires_grad_(false);
    try {
      ddp.refresh_trainable();
      ADD_FAILURE() << "refresh with unreduced no_sync gradients must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("no_sync() gradients are waiting"), std::string::npos) << e.what();
    }
    ddp.reduce();
    ddp.refresh_trainable();
    EXPECT_FALSE(net->params[0].grad().defined() && oss.owner(net->params[0]) != g->rank());
  });
}

// A backward that raises after some gradients were reduced leaves the reductions incomplete: the
// next forward() is an error saying so, on every rank that raised, not a collective paired with
// the wrong one.
struct RaiseInBackward : torch::autograd::Function<RaiseInBackward> {
  static at::Tensor forward(torch::autograd::AutogradContext*, at::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("raised in backward");
  }
};

struct Breakable : torch::nn::Module {
  Breakable() {
    a = register_module("a", torch::nn::Linear(5, 4));
    b = register_module("b", torch::nn::Linear(4, 3));
  }
  at::Tensor forward(at::Tensor x) {
    at::Tensor h = a->forward(x);
    if (raise) h = RaiseInBackward::apply(h);
    return b->forward(h);  // b's gradients are ready (and reduced) before the raise
  }
  torch::nn::Linear a{nullptr}, b{nullptr};
  bool raise = false;
};

TEST(ShardedDDP, ABackwardThatRaisedMidwayMakesTheNextForwardAnError) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Breakable>();
    OSS oss(net->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1)), g);
    ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(0));
    const at::Tensor x = at::ones({2, 5}) * (g->rank() + 1);
    ddp.forward(x).sum().backward();
    oss.step();
    net->raise = true;
    EXPECT_ANY_THROW(ddp.forward(x).sum().backward());
    net->raise = false;
    try {
      ddp.forward(x);
      ADD_FAILURE() << "forward() after a backward that raised must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("the last backward on this rank raised an error"), std::string::npos)
          << e.what();
    }
  });
}

// A re-partition between backward and step (refresh_trainable by hand) hands each moved,
// already reduced gradient to its new owner, so the step still applies it.
TEST(ShardedDDP, RepartitionBetweenBackwardAndStepMovesTheReducedGradients) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TinyNet>();
    Params ref = testing::clone_params(net->params);
    optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g,
            OSSOptions().partition(PartitionMode::kWholeParameters));
    ShardedDDP ddp(net, oss, ShardedDDPOptions().auto_refresh_trainable(false));
    for (int step = 0; step < 3; ++step) {
      auto data = testing::rank_data(step, g->rank(), 4);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      ref_opt.zero_grad(true);
      ddp.zero_grad(true);
      testing::loss(ref, data, 4).backward();
      testing::allreduce_grads(ref, *g);
      testing::loss_of(ddp.forward(data.x, true), data, 4).backward();
      if (step == 1) {
        for (Params* q : {&net->params, &ref}) (*q)[0].requires_grad_(false), (*q)[2].requires_grad_(false);
        ref[0].mutable_grad().reset();  // OSS never moves a frozen parameter; plain Adam would
        ref[2].mutable_grad().reset();
        std::vector<int> owners_before;
        for (auto& p : net->params) owners_before.push_back(oss.owner(p));
        ddp.refresh_trainable();
        ASSERT_EQ(Introspection::partition_version(oss), 1);
        int moved_trainable = 0;
        for (int i : {1, 3, 4}) moved_trainable += oss.owner(net->params[i]) != owners_before[i];
        ASSERT_GT(moved_trainable, 0) << "the test needs a trainable parameter that changes owner";
      }
      for (auto& p : net->params) {
        if (oss.owner(p) != g->rank()) EXPECT_FALSE(p.grad().defined()) << "a non-owner holds a gradient";
      }
      ref_opt.step();
      oss.step();
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_LE(testing::rel_diff(net->params[i], ref[i]), 1e-5) << "parameter " << i << " after step " << step;
      }
      ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g));
    }
  });
}

TEST(ShardedDDP, TrainEvalIsNotATrainabilityChangeAndBuffersFollowRankZero) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TinyNet>();
    // Different starting values on each rank: sync_models_at_startup makes them rank 0's.
    {
      at::NoGradGuard no_grad;
      net->params[0].add_(g->rank());
      net->stat.fill_(g->rank() + 1);
    }
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g);
    ShardedDDP ddp(net, oss);
    EXPECT_TRUE(testing::same_on_all_ranks(net->params, *g));
    const auto rebuilds = ddp.rebuild_count();
    net->eval();
    ddp.forward(at::ones({2, 5}), true);
    net->train();
    {
      at::NoGradGuard no_grad;
      net->stat.fill_(10 + g->rank());
    }
    ddp.forward(at::ones({2, 5}), true);
    EXPECT_EQ(ddp.rebuild_count(), rebuilds);
    EXPECT_TRUE(net->stat.equal(at::full({2}, 10.0f))) << "buffers follow rank 0";
  });
}

// With parameters aligned in the flat layout, bucket slots have gaps; the gaps are zeroed, never
// read as gradients, and parity holds through freezing, accumulation and two optimizers.
TEST(ShardedDDP, AlignedLayoutKeepsParity) {
  for (int64_t align : {int64_t{16}, int64_t{64}}) {
    for (int64_t bucket_bytes : {int64_t{0}, int64_t{160}, int64_t{1} << 20}) {
      for (bool two : {false, true}) {
        DdpParity p;
        p.align = align;
        p.bucket_bytes = bucket_bytes;
        p.change_trainability = true;
        p.accumulate = bucket_bytes == 160;
        p.two_optimizers = two;
        SCOPED_TRACE(p.name());
        p.run();
      }
    }
  }
}

// ShardedDDP reduces exactly the buckets of the optimizer's layout: after a freeze the frozen
// parameters are in no bucket, and after a rebalance the buckets follow the new owners.
TEST(ShardedDDP, BucketsAreTheOptimizersLayoutBuckets) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TinyNet>();
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g,
            OSSOptions().partition(PartitionMode::kWholeParameters));
    ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(0));
    auto run_step = [&](int step) {
      auto data = testing::rank_data(step, g->rank(), 4);
      ddp.zero_grad(true);
      testing::loss_of(ddp.forward(data.x, true), data, 4).backward();
      oss.step();
    };
    run_step(0);
    EXPECT_EQ(ddp.num_buckets(), oss.layout().buckets().size());
    EXPECT_EQ(ddp.num_buckets(), net->params.size());  // bucket_bytes 0: one per parameter
    const auto version = testing::Introspection::layout_version(oss);
    net->params[0].requires_grad_(false);
    net->params[2].requires_grad_(false);
    run_step(1);  // the forward lays out for the new set
    EXPECT_GT(testing::Introspection::layout_version(oss), version);
    EXPECT_EQ(ddp.num_buckets(), net->params.size() - 2);
    EXPECT_EQ(ddp.num_buckets(), oss.layout().buckets().size());
    for (size_t i : {0u, 2u}) EXPECT_EQ(oss.layout().pieces()[oss.layout().pieces_of(i)[0]].bucket, -1);
    run_step(2);  // the next forward re-partitions for the agreed set
    for (const auto& b : oss.layout().buckets()) {
      for (size_t k : b.pieces) EXPECT_EQ(oss.owner(net->params[oss.layout().pieces()[k].param]), b.owner);
    }
    // The parameters are views of the layout's buffer, at the ranges it gives.
    for (size_t i = 0; i < net->params.size(); ++i) {
      const Piece& piece = oss.layout().pieces()[oss.layout().pieces_of(i)[0]];
      const at::Tensor& first = net->params[0];
      const auto* base = static_cast<const char*>(net->params[i].data_ptr()) -
                         oss.layout().in_buffer(piece).begin * static_cast<int64_t>(first.element_size());
      const Piece& p0 = oss.layout().pieces()[oss.layout().pieces_of(0)[0]];
      EXPECT_EQ(base, static_cast<const char*>(first.data_ptr()) -
                          oss.layout().in_buffer(p0).begin * static_cast<int64_t>(first.element_size()))
          << "parameter " << i << " is not where the layout puts it";
    }
  });
}

// Split ranges under ShardedDDP: each rank reduces and keeps only its 1/world of the gradients,
// pieces of one tensor go to several owners, and training matches DDP + Adam through freezing
// and unfreezing the dominant tensor, clipping, accumulation under no_sync and every
// set-to-none way of clearing.
TEST(ShardedDDP, SplitRangesOfADominantTensorKeepParityAndHoldOneWorldthOfTheGradients) {
  for (int world : {2, 3, 4}) {
    for (int64_t bucket_bytes : {int64_t{0}, int64_t{8} << 20}) {
      SCOPED_TRACE("world " + std::to_string(world) + " buckets " + std::to_string(bucket_bytes));
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<testing::DominantNet>();
        Params ref = testing::clone_params(net->params);
        optim::Adam ref_opt(ref, optim::AdamOptions(1e-2));
        OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
        ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(bucket_bytes));
        ASSERT_TRUE(Introspection::split(oss));
        ASSERT_EQ(oss.owners(net->params[1]).size(), static_cast<size_t>(world));
        for (int step = 0; step < 7; ++step) {
          for (Params* q : {&ref, &net->params}) {
            (*q)[1].requires_grad_(step < 2 || step > 3);  // D frozen at steps 2 and 3
            (*q)[0].requires_grad_(step != 5);
          }
          ref_opt.zero_grad(true);
          if (step % 3 == 0) {
            ddp.zero_grad(true);
          } else if (step % 3 == 1) {
            oss.zero_grad(true);
          } else {
            net->zero_grad(true);
          }
          for (int micro = 0; micro < 2; ++micro) {
            auto data = testing::rank_data(2 * step + micro, g->rank(), 3);
            if (step == 0 && micro == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
            testing::loss_of(testing::dominant_output(ref, data.x), data, 3).backward();
            at::Tensor out = ddp.forward(data.x);
            if (micro == 0) {
              auto guard = ddp.no_sync();
              testing::loss_of(out, data, 3).backward();
            } else {
              testing::loss_of(out, data, 3).backward();
            }
          }
          testing::allreduce_grads(ref, *g);
          int64_t trainable_bytes = 0;
          Params with_grad;
          for (auto& p : ref) {
            if (!p.requires_grad()) continue;
            trainable_bytes += p.numel() * 4;
            with_grad.push_back(p);
          }
          const double ideal = static_cast<double>(trainable_bytes) / world;
          EXPECT_LE(ddp.local_grad_bytes(), 1.03 * ideal) << "step " << step;
          EXPECT_GE(ddp.local_grad_bytes(), 0.97 * ideal) << "step " << step;
          const double expected = torch::nn::utils::clip_grad_norm_(with_grad, 0.5);
          ASSERT_NEAR(oss.clip_grad_norm(0.5), expected, 1e-5 * std::max(1.0, expected)) << "step " << step;
          for (auto& p : ref) {
            if (!p.requires_grad()) p.mutable_grad().reset();
          }
          ref_opt.step();
          oss.step();
          ASSERT_TRUE(testing::matches_reference(net->params, ref, *g, 1e-5)) << "after step " << step;
        }
      });
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TEST(ShardedDDP, SplitGradientBytesAreOneWorldthAtWorldEight) {
  run_ranks(8, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<testing::DominantNet>();
    OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
    ShardedDDP ddp(net, oss);
    auto data = testing::rank_data(0, g->rank(), 2);
    testing::loss_of(ddp.forward(data.x), data, 2).backward();
    int64_t total = 0;
    for (const auto& p : net->params) total += p.numel() * 4;
    EXPECT_NEAR(static_cast<double>(ddp.local_grad_bytes()), total / 8.0, 0.03 * total / 8.0) << "rank " << g->rank();
    oss.step();
    EXPECT_NEAR(static_cast<double>(oss.local_state_bytes()), 2.0 * total / 8.0, 0.03 * 2.0 * total / 8.0);
  });
}

// Accumulating two micro-batches: under no_sync() each rank holds every trainable parameter's
// whole gradient (DDP's no_sync, FSDP2's set_requires_gradient_sync(False)) until the next
// backward outside it reduces them, after which it holds one share again; without no_sync and
// without clearing, every backward reduces and the shares accumulate, so a rank never holds more
// than its share (FSDP2's default). At 2 and 4 ranks, with each rank's data different.
TEST(ShardedDDP, NoSyncHoldsWholeGradientsUntilTheReductionAndShardsAccumulateInTheirShare) {
  for (int world : {2, 4}) {
    for (const bool under_no_sync : {true, false}) {
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto net = std::make_shared<testing::DominantNet>();
        OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
        ShardedDDP ddp(net, oss);
        int64_t total = 0;
        for (const auto& p : net->params) total += p.numel() * 4;
        const double share = static_cast<double>(total) / world;
        for (int step = 0; step < 2; ++step) {
          ddp.zero_grad();
          for (int m = 0; m < 2; ++m) {
            auto data = testing::rank_data(2 * step + m, g->rank(), 2);
            if (step == 0 && m == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g)) << "data must differ";
            at::Tensor out = ddp.forward(data.x);
            if (m == 0 && under_no_sync) {
              auto local = ddp.no_sync();
              testing::loss_of(out, data, 2).backward();
              EXPECT_EQ(ddp.local_grad_bytes(), total) << "whole gradients under no_sync, rank " << g->rank();
            } else {
              testing::loss_of(out, data, 2).backward();
              EXPECT_NEAR(static_cast<double>(ddp.local_grad_bytes()), share, 0.03 * share)
                  << "one share after a reduction, rank " << g->rank() << ", micro-batch " << m;
            }
          }
          oss.step();
        }
      });
    }
  }
}

// Under a ShardedDDP the step leaves the trainability check to the forward, whose overlapped
// all-reduce carries the optimizers' options too (Note [Optimizers agree across ranks]): a
// learning rate changed on rank 1 alone fails on both ranks before any gradient is reduced.
TEST(ShardedDDP, AnOptionChangedOnOneRankFailsAtTheNextForwardOnEveryRank) {
  auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<TinyNet>();
    OSS oss(net->parameters(), optimizer<optim::SGD>(optim::SGDOptions(0.1).momentum(0.9)), g);
    ShardedDDP ddp(net, oss);
    for (int step = 0; step < 2; ++step) {
      if (step == 1 && g->rank() == 1) static_cast<optim::SGDOptions&>(oss.param_groups()[0].options()).lr(0.05);
      ddp.zero_grad(true);
      auto d = testing::rank_data(step, g->rank(), 4);
      ((ddp.forward(d.x, true) - d.y).pow(2).sum()).backward();
      oss.step();
    }
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(errors[r], ::testing::HasSubstr("ranks disagree on param group 0's lr (SGD): 0.1 on rank 0 but 0.05 on rank 1"))
        << "rank " << r;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
