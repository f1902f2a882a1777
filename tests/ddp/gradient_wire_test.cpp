// ShardedDDPOptions::gradient_wire (Note [Gradient wire] in csrc/comm/wire.cpp): with kBFloat16,
// each owner's reduced gradient is the sum, in fp32, of every rank's gradient rounded to bf16 (its
// own first, then the others in rank order), divided by the world size: checked bit for bit
// against a reference built from every rank's local gradient, at worlds 2, 3 and 4, with row
// buckets (the default) and with whole parameters, each rank's data different. The bytes the
// reduce-scatters move are half of the exact wire's, every rank's parameters stay bitwise equal
// after the step, and a wire that differs between ranks, or bf16 over fp16, is an error on every
// rank. The int8 wire runs both ways a group takes it: Gloo's direct transfers, and the
// all-to-all and gather NCCL takes.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/grad_scaler.h>
#include <shardopt/optim/oss.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// 5 -> 24 -> 24 -> 3: 795 elements in 6 tensors.
torch::nn::Sequential net_of(uint64_t seed) {
  auto made = torch::nn::Sequential(torch::nn::Linear(5, 24), torch::nn::Tanh(), torch::nn::Linear(24, 24),
                                    torch::nn::Tanh(), torch::nn::Linear(24, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

optim::AdamWOptions adamw() { return optim::AdamWOptions(1e-2).weight_decay(0.01); }

// Every rank's local gradient of each parameter, flattened: all[param][rank].
std::vector<std::vector<at::Tensor>> all_local_grads(const Params& local, ProcessGroup& g) {
  std::vector<std::vector<at::Tensor>> all;
  for (const auto& p : local) {
    std::vector<at::Tensor> out;
    for (int r = 0; r < g.size(); ++r) out.push_back(at::empty({p.numel()}));
    g.allgather(out, p.grad().reshape(-1).contiguous());
    all.push_back(out);
  }
  return all;
}

// The reduction a bf16 wire gives the owner `owner` of elements [begin, end) of one parameter.
at::Tensor bf16_reference(const std::vector<at::Tensor>& per_rank, int owner, int64_t begin, int64_t end) {
  auto rounded = [&](int r) { return per_rank[r].narrow(0, begin, end - begin).to(at::kBFloat16).to(at::kFloat); };
  at::Tensor sum = rounded(owner);
  for (int r = 0; r < static_cast<int>(per_rank.size()); ++r) {
    if (r != owner) sum = sum + rounded(r);
  }
  return sum / static_cast<double>(per_rank.size());
}

// One backward and step at each world size under `options`; returns the reduce-scatter and reduce
// bytes this rank moved in the backward.
int64_t check_bf16_wire(int world, OSSOptions oss_options) {
  int64_t bytes = 0;
  run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7), local = net_of(7);
    Params params = net->parameters();
    OSS oss(params, optimizer<optim::AdamW>(adamw()), g, oss_options);
    ShardedDDP ddp(net.ptr(), oss,
                   ShardedDDPOptions().gradient_wire(Wire::kBFloat16).reduce_bucket_bytes(1024).bucket_bytes_per_rank(0));
    const auto data = testing::rank_data(0, g->rank(), 2);
    ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
    // Each rank's own gradient, computed apart.
    testing::loss_of(local->forward(data.x), data, 1).backward();
    const auto all = all_local_grads(local->parameters(), *g);

    const CommStats before = g->stats();
    ddp.zero_grad();
    testing::loss_of(ddp.forward(data.x), data, 1).backward();
    const CommStats& after = g->stats();
    if (g->rank() == 0) {
      bytes = after.bytes[CommStats::kReduceScatter] - before.bytes[CommStats::kReduceScatter] +
              after.bytes[CommStats::kReduce] - before.bytes[CommStats::kReduce];
    }
    // The gradients this rank owns, in OSS::grads(true)'s order: each trainable parameter's ranges
    // held by this rank.
    const std::vector<at::Tensor> owned = oss.grads(/*owned_only=*/true);
    size_t next = 0;
    int64_t checked = 0, differs_from_exact = 0;
    for (size_t i = 0; i < params.size(); ++i) {
      for (const auto& h : testing::Introspection::holdings(oss, i)) {
        if (h.rank != g->rank()) continue;
        ASSERT_LT(next, owned.size());
        const at::Tensor got = owned[next++].reshape(-1);
        const at::Tensor want = bf16_reference(all[i], g->rank(), h.in_param.begin, h.in_param.end);
        ASSERT_TRUE(at::equal(got, want)) << "parameter " << i << " [" << h.in_param.begin << ", " << h.in_param.end
                                          << "), max diff " << (got - want).abs().max().item<double>();
        at::Tensor exact = at::zeros_like(want);
        for (const auto& t : all[i]) exact += t.narrow(0, h.in_param.begin, h.in_param.size());
        differs_from_exact += (got != exact / static_cast<double>(world)).sum().item<int64_t>();
        checked += got.numel();
      }
    }
    EXPECT_EQ(next, owned.size());
    EXPECT_GT(checked, 0) << "rank " << g->rank() << " owns no gradient";
    // The wire rounded something: most reductions differ from the exact one somewhere.
    const auto total = g->allgather_ints({differs_from_exact});
    int64_t any = 0;
    for (const auto& v : total) any += v[0];
    EXPECT_GT(any, 0) << "the bf16 wire gave the exact reduction everywhere";
    oss.step();
    ddp.finish_param_sync();
    EXPECT_TRUE(testing::same_on_all_ranks(params, *g));
  });
  return bytes;
}

int64_t exact_bytes(int world, OSSOptions oss_options) {
  int64_t bytes = 0;
  run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g, oss_options);
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().reduce_bucket_bytes(1024).bucket_bytes_per_rank(0));
    const auto data = testing::rank_data(0, g->rank(), 2);
    const CommStats before = g->stats();
    testing::loss_of(ddp.forward(data.x), data, 1).backward();
    const CommStats& after = g->stats();
    if (g->rank() == 0) {
      bytes = after.bytes[CommStats::kReduceScatter] - before.bytes[CommStats::kReduceScatter] +
              after.bytes[CommStats::kReduce] - before.bytes[CommStats::kReduce];
    }
  });
  return bytes;
}

TEST(GradientWire, Bf16RowBucketsSumTheRoundedGradientsInFp32AndMoveHalfTheBytes) {
  for (int world : {2, 3, 4}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const int64_t bf16 = check_bf16_wire(world, OSSOptions());
    EXPECT_EQ(2 * bf16, exact_bytes(world, OSSOptions()));
  }
}

TEST(GradientWire, Bf16WholeParameterBucketsSumTheRoundedGradientsInFp32) {
  const auto whole = OSSOptions().partition(PartitionMode::kWholeParameters);
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    const int64_t bf16 = check_bf16_wire(world, whole);
    EXPECT_EQ(2 * bf16, exact_bytes(world, whole));
  }
}

// The int8 wire (Note [Int8 wire]) through ShardedDDP, row buckets and whole parameters, one
// backward and step: each owner's gradient is within the quantisation's half step of the exact
// mean (each rank's contribution off by at most max |block| / 254), the reduce bytes are about a
// quarter of the exact wire's (one byte an element, four a block of 256, the flags exact), and
// every rank's parameters stay equal.
TEST(GradientWire, Int8StaysWithinHalfAStepOfTheExactMeanAtAQuarterOfTheBytes) {
  for (int world : {2, 3, 4}) {
    for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
      SCOPED_TRACE("world " + std::to_string(world) + (partition == PartitionMode::kSplit ? ", rows" : ", whole"));
      int64_t bytes[2] = {0, 0};
      for (int int8 : {0, 1}) {
        run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
          auto net = net_of(7), local = net_of(7);
          Params params = net->parameters();
          OSS oss(params, optimizer<optim::AdamW>(adamw()), g, OSSOptions().partition(partition));
          ShardedDDP ddp(net.ptr(), oss,
                         ShardedDDPOptions().gradient_wire(int8 ? Wire::kInt8 : Wire::kExact).reduce_bucket_bytes(1024));
          const auto data = testing::rank_data(0, g->rank(), 2);
          ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          testing::loss_of(local->forward(data.x), data, 1).backward();
          const auto all = all_local_grads(local->parameters(), *g);
          double largest = 0;  // the largest local gradient element of any rank
          for (const auto& per_rank : all) {
            for (const auto& t : per_rank) largest = std::max(largest, t.abs().max().item<double>());
          }
          const CommStats before = g->stats();
          testing::loss_of(ddp.forward(data.x), data, 1).backward();
          const CommStats& after = g->stats();
          if (g->rank() == 0) {
            bytes[int8] = after.bytes[CommStats::kReduceScatter] - before.bytes[CommStats::kReduceScatter] +
                          after.bytes[CommStats::kReduce] - before.bytes[CommStats::kReduce];
          }
          const auto owned = oss.grads(/*owned_only=*/true);
          size_t next = 0;
          double off = 0;
          for (size_t i = 0; i < params.size(); ++i) {
            for (const auto& h : testing::Introspection::holdings(oss, i)) {
              if (h.rank != g->rank()) continue;
              at::Tensor exact = at::zeros({h.in_param.size()});
              for (const auto& t : all[i]) exact += t.narrow(0, h.in_param.begin, h.in_param.size());
              off = std::max(off, (owned[next++].reshape(-1) - exact / world).abs().max().item<double>());
            }
          }
          EXPECT_EQ(next, owned.size());
          // The mean of `world` contributions, each off by at most half a step of its block.
          EXPECT_LE(off, largest / 254 * 1.0001) << "rank " << g->rank();
          if (int8) EXPECT_GT(off, 0) << "int8 rounded nothing on rank " << g->rank();
          oss.step();
          EXPECT_TRUE(testing::same_on_all_ranks(params, *g));
        });
      }
      EXPECT_GT(bytes[1], bytes[0] / 4);
      EXPECT_LT(bytes[1], bytes[0] * 0.3) << bytes[1] << " of " << bytes[0];
    }
  }
}

// Gradient accumulation under no_sync() on the int8 wire: the micro-batches' gradients add up
// locally and are quantised once, by the reduction of the last backward (none before it, and it
// moves the bytes of one reduction); each owner's gradient is within half a step of the exact
// mean of the accumulated sums; and clipping sees that reduced gradient: the norm
// clip_grad_norm() returns is the owners' dequantised gradients' norm.
TEST(GradientWire, Int8AccumulationQuantisesOncePerReductionAndClippingSeesTheReducedGradient) {
  auto wire_bytes = [](const CommStats& after, const CommStats& before) {
    return after.bytes[CommStats::kReduceScatter] - before.bytes[CommStats::kReduceScatter] +
           after.bytes[CommStats::kReduce] - before.bytes[CommStats::kReduce];
  };
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = net_of(7), local = net_of(7);
      Params params = net->parameters();
      OSS oss(params, optimizer<optim::AdamW>(adamw()), g);
      ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().gradient_wire(Wire::kInt8).reduce_bucket_bytes(1024));
      const auto a = testing::rank_data(0, g->rank(), 2), b = testing::rank_data(1, g->rank(), 2);
      ASSERT_TRUE(testing::differs_across_ranks(a.x, *g));
      // Each rank's accumulated gradient, computed apart.
      testing::loss_of(local->forward(a.x), a, 1).backward();
      testing::loss_of(local->forward(b.x), b, 1).backward();
      const auto all = all_local_grads(local->parameters(), *g);
      double largest = 0;
      for (const auto& per_rank : all) {
        for (const auto& t : per_rank) largest = std::max(largest, t.abs().max().item<double>());
      }
      // The bytes of one reduction, without accumulation.
      CommStats before = g->stats();
      testing::loss_of(ddp.forward(a.x), a, 1).backward();
      const int64_t one = wire_bytes(g->stats(), before);
      ASSERT_GT(one, 0);
      ddp.zero_grad();
      {
        auto accumulating = ddp.no_sync();
        before = g->stats();
        testing::loss_of(ddp.forward(a.x), a, 1).backward();
        EXPECT_EQ(wire_bytes(g->stats(), before), 0) << "a backward under no_sync() reduced something";
      }
      before = g->stats();
      testing::loss_of(ddp.forward(b.x), b, 1).backward();
      EXPECT_EQ(wire_bytes(g->stats(), before), one) << "the accumulated gradients are reduced once";
      const auto owned = oss.grads(/*owned_only=*/true);
      size_t next = 0;
      double off = 0, squares = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        for (const auto& h : testing::Introspection::holdings(oss, i)) {
          if (h.rank != g->rank()) continue;
          at::Tensor exact = at::zeros({h.in_param.size()});
          for (const auto& t : all[i]) exact += t.narrow(0, h.in_param.begin, h.in_param.size());
          off = std::max(off, (owned[next].reshape(-1) - exact / world).abs().max().item<double>());
          squares += owned[next++].pow(2).sum().item<double>();
        }
      }
      ASSERT_EQ(next, owned.size());
      EXPECT_LE(off, largest / 254 * 1.0001);
      EXPECT_GT(off, 0) << "int8 rounded nothing";
      at::Tensor total = at::tensor({squares}, at::kDouble);
      g->allreduce(total);
      const double norm = oss.clip_grad_norm(1e9);
      EXPECT_NEAR(norm, std::sqrt(total.item<double>()), 1e-5 * norm);
    });
  }
}

// The int8 wire as an NCCL group takes it (Note [Int8 wire on collectives]: one all-to-all per
// row bucket, one gather per bucket reduced to one owner), here on Gloo, int8 parameters and
// error feedback on, through a freeze and an unfreeze, rows and whole parameters, each rank's
// data different: after every step rank 0's parameters are bit for bit those of Gloo's direct
// transfers, every rank holds the same, and each step counts the same number of collectives.
TEST(GradientWire, Int8OnCollectivesTrainsBitForBitAsOnDirectTransfers) {
  for (auto partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    SCOPED_TRACE(partition == PartitionMode::kSplit ? "rows" : "whole parameters");
    std::vector<Params> after[2];  // rank 0's parameters after each step, per route
    std::vector<int64_t> calls[2];
    for (int collectives : {0, 1}) {
      run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
        if (collectives) testing::Introspection::wire_by_collectives(*g);
        auto net = net_of(7);
        Params params = net->parameters();
        OSS oss(params, optimizer<optim::AdamW>(adamw()), g,
                OSSOptions().partition(partition).param_wire(Wire::kInt8));
        ShardedDDP ddp(net.ptr(), oss,
                       ShardedDDPOptions().gradient_wire(Wire::kInt8).error_feedback(true).reduce_bucket_bytes(1024));
        for (int step = 0; step < 5; ++step) {
          for (auto& p : net[0]->parameters()) p.requires_grad_(step != 2);
          const auto data = testing::rank_data(step, g->rank(), 2);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          const CommStats before = g->stats();
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 1).backward();
          oss.step();
          ASSERT_TRUE(testing::same_on_all_ranks(params, *g)) << "step " << step;
          if (g->rank() != 0) continue;
          Params copy;
          for (const auto& p : params) copy.push_back(p.detach().clone());
          after[collectives].push_back(copy);
          calls[collectives].push_back(g->stats().total_calls() - before.total_calls());
        }
      });
    }
    ASSERT_EQ(after[0].size(), 5u);
    ASSERT_EQ(after[1].size(), 5u);
    for (size_t step = 0; step < 5; ++step) {
      for (size_t i = 0; i < after[0][step].size(); ++i) {
        EXPECT_TRUE(after[0][step][i].equal(after[1][step][i])) << "step " << step << " parameter " << i;
      }
    }
    EXPECT_EQ(calls[0], calls[1]);
  }
}

// An inf in one rank's gradient survives the int8 wire (its block arrives NaN, Note [Int8 wire]):
// the gradient scaler finds it after the reduction and every rank skips the step.
TEST(GradientWire, Int8KeepsAnOverflowVisibleToTheGradScaler) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    Params params = net->parameters();
    OSS oss(params, optimizer<optim::AdamW>(adamw()), g,
            OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf).reduce_dtype(at::kFloat)));
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().gradient_wire(Wire::kInt8).reduce_bucket_bytes(1024));
    ShardedGradScaler scaler(GradScalerOptions().init_scale(1024));
    for (int step = 0; step < 3; ++step) {
      const bool overflow = step == 1;
      const auto data = testing::rank_data(step, g->rank(), 2);
      unsigned hook = 0;
      if (overflow && g->rank() == 1) {
        hook = params[0].register_hook(
            [](const at::Tensor& grad) { return at::full_like(grad, std::numeric_limits<float>::infinity()); });
      }
      const Params before = testing::clone_params(params);
      ddp.zero_grad();
      scaler.scale(testing::loss_of(ddp.forward(data.x), data, 1)).backward();
      if (overflow && g->rank() == 1) params[0].remove_hook(hook);
      const bool stepped = scaler.step(oss);
      scaler.update();
      EXPECT_EQ(stepped, !overflow) << "step " << step << " on rank " << g->rank();
      int64_t changed = 0;
      for (size_t i = 0; i < params.size(); ++i) changed += params[i].ne(before[i]).sum().item<int64_t>();
      if (overflow) {
        EXPECT_EQ(changed, 0) << "the skipped step changed parameters on rank " << g->rank();
      } else {
        EXPECT_GT(changed, 0) << "step " << step;
      }
      ASSERT_TRUE(testing::same_on_all_ranks(params, *g));
    }
  });
}

// Error feedback (Note [Error feedback]): eight backward passes over the same data, no step. On a
// plain bf16 wire every pass gives the owner the same rounded reduction; with error feedback the
// first pass gives that too (nothing to feed back yet), and the mean of the eight passes comes
// within a fraction of the plain wire's error of the exact mean, because each rank's roundings
// cancel over the passes. The residuals are bf16, one per element each rank sends.
TEST(GradientWire, ErrorFeedbackCancelsTheRoundingOverReductions) {
  constexpr int kPasses = 8;
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      const auto data = testing::rank_data(0, g->rank(), 2);
      ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      auto local = net_of(7);
      testing::loss_of(local->forward(data.x), data, 1).backward();
      const auto all = all_local_grads(local->parameters(), *g);
      // Per feedback setting: the owned gradients of the first pass, and the mean of all passes.
      std::vector<at::Tensor> first[2], mean[2], exact;
      for (int feedback : {0, 1}) {
        auto net = net_of(7);
        OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g);
        ShardedDDP ddp(net.ptr(), oss,
                       ShardedDDPOptions().gradient_wire(Wire::kBFloat16).error_feedback(feedback != 0).reduce_bucket_bytes(1024));
        EXPECT_EQ(ddp.error_feedback_bytes(), 0);
        for (int pass = 0; pass < kPasses; ++pass) {
          ddp.zero_grad();
          testing::loss_of(ddp.forward(data.x), data, 1).backward();
          const auto owned = oss.grads(/*owned_only=*/true);
          for (size_t k = 0; k < owned.size(); ++k) {
            const at::Tensor got = owned[k].reshape(-1).clone();
            if (pass == 0) {
              first[feedback].push_back(got);
              mean[feedback].push_back(got / kPasses);
            } else {
              mean[feedback][k] += got / kPasses;
            }
          }
        }
        const int64_t trainable = 795;
        if (feedback) {
          // bf16: two bytes per element sent, at least the model's, never fp32's four.
          EXPECT_GE(ddp.error_feedback_bytes(), 2 * trainable);
          EXPECT_LT(ddp.error_feedback_bytes(), 4 * trainable);
        } else {
          EXPECT_EQ(ddp.error_feedback_bytes(), 0);
          size_t next = 0;
          for (size_t i = 0; i < net->parameters().size(); ++i) {
            for (const auto& h : testing::Introspection::holdings(oss, i)) {
              if (h.rank != g->rank()) continue;
              at::Tensor sum = at::zeros({h.in_param.size()});
              for (const auto& t : all[i]) sum += t.narrow(0, h.in_param.begin, h.in_param.size());
              exact.push_back(sum / static_cast<double>(world));
              ++next;
            }
          }
          ASSERT_EQ(next, first[0].size());
        }
      }
      ASSERT_EQ(first[0].size(), first[1].size());
      double plain = 0, fed = 0;
      for (size_t k = 0; k < exact.size(); ++k) {
        EXPECT_TRUE(at::equal(first[0][k], first[1][k])) << "range " << k << ": the first pass has nothing to feed back";
        plain = std::max(plain, (mean[0][k] - exact[k]).abs().max().item<double>());
        fed = std::max(fed, (mean[1][k] - exact[k]).abs().max().item<double>());
      }
      const auto plains = g->allgather_ints({static_cast<int64_t>(plain * 1e12)});
      const auto feds = g->allgather_ints({static_cast<int64_t>(fed * 1e12)});
      int64_t plain_all = 0, fed_all = 0;
      for (size_t r = 0; r < plains.size(); ++r) {
        plain_all = std::max(plain_all, plains[r][0]);
        fed_all = std::max(fed_all, feds[r][0]);
      }
      EXPECT_GT(plain_all, 0) << "the plain bf16 wire rounded nothing";
      EXPECT_LT(4 * fed_all, plain_all) << "error feedback: " << fed_all << ", plain: " << plain_all << " (1e-12)";
    });
  }
}

// A freeze and an unfreeze each build the buckets anew, and their residuals start at zero (Note
// [Error feedback]): the frozen parameters' residuals are dropped, error_feedback_bytes() falls to
// two bytes per element still sent and comes back after the unfreeze, and the first reduction of
// each new layout is the plain wire's, bit for bit. The run without feedback is given the
// parameters of the run with it before each compared step, on the same data, so only the
// residuals can differ; at the step before the freeze they do, which shows the comparison sees
// them.
TEST(GradientWire, AFreezeOrAnUnfreezeStartsTheResidualsAtZero) {
  for (Wire wire : {Wire::kBFloat16, Wire::kInt8}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(wire == Wire::kInt8 ? "int8" : "bf16") + ", world " + std::to_string(world));
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto fed_net = net_of(7), plain_net = net_of(7);
        Params fed_params = fed_net->parameters(), plain_params = plain_net->parameters();
        OSS fed_oss(fed_params, optimizer<optim::AdamW>(adamw()), g);
        OSS plain_oss(plain_params, optimizer<optim::AdamW>(adamw()), g);
        const auto options = ShardedDDPOptions().gradient_wire(wire).reduce_bucket_bytes(1024);
        ShardedDDP fed(fed_net.ptr(), fed_oss, ShardedDDPOptions(options).error_feedback(true));
        ShardedDDP plain(plain_net.ptr(), plain_oss, options);
        const int64_t first_two = 5 * 24 + 24;  // the first layer's elements
        // Steps 0-1 train everything, 2-3 with the first layer frozen, 4 with it unfrozen.
        for (int step = 0; step < 5; ++step) {
          if (step == 2 || step == 4) {
            for (size_t i = 0; i < 2; ++i) {
              fed_params[i].requires_grad_(step == 4);
              plain_params[i].requires_grad_(step == 4);
            }
          }
          {
            at::NoGradGuard no_grad;
            for (size_t i = 0; i < fed_params.size(); ++i) plain_params[i].copy_(fed_params[i]);
          }
          const auto data = testing::rank_data(step, g->rank(), 2);
          if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
          fed.zero_grad();
          plain.zero_grad();
          testing::loss_of(fed.forward(data.x), data, 1).backward();
          testing::loss_of(plain.forward(data.x), data, 1).backward();
          const auto got = fed_oss.grads(/*owned_only=*/true), want = plain_oss.grads(/*owned_only=*/true);
          ASSERT_EQ(got.size(), want.size());
          int64_t unequal = 0;
          for (size_t k = 0; k < got.size(); ++k) unequal += !at::equal(got[k], want[k]);
          int64_t unequal_anywhere = 0;
          for (const auto& v : g->allgather_ints({unequal})) unequal_anywhere += v[0];
          const bool new_layout = step == 0 || step == 2 || step == 4;
          if (new_layout) {
            EXPECT_EQ(unequal_anywhere, 0) << "step " << step << ": a new layout's first reduction feeds back nothing";
          } else {
            EXPECT_GT(unequal_anywhere, 0) << "step " << step << ": the residuals were fed back";
          }
          // Two bytes per element this rank sends: the whole model's, or all but the first layer's.
          const int64_t sent = step >= 2 && step < 4 ? 795 - first_two : 795;
          EXPECT_GE(fed.error_feedback_bytes(), 2 * sent) << "step " << step;
          EXPECT_LT(fed.error_feedback_bytes(), 2 * sent + 2 * 256 * world) << "step " << step;
          fed_oss.step();
          plain_oss.step();
        }
      });
    }
  }
}

// Error feedback under plain SGD, whose update is linear in the gradient. A loss linear in the
// parameters, sum(c * (x W^T + b)), gives each rank a fixed gradient of its own (W: c^T x, b: the
// column sums of c). Over 50 steps the mean update, (p_0 - p_50) / (50 lr), is the exact mean
// gradient to within one residual / 50 with feedback; without it every step rounds alike, and
// the mean keeps the whole rounding error.
TEST(GradientWire, ErrorFeedbackMakesTheMeanSgdUpdateOverFiftyStepsTheExactOne) {
  constexpr int kSteps = 50;
  constexpr double kLr = 0.1;
  for (Wire wire : {Wire::kBFloat16, Wire::kInt8}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(wire == Wire::kInt8 ? "int8" : "bf16") + ", world " + std::to_string(world));
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + g->rank());
        const at::Tensor x = at::randn({4, 5}, gen), c = at::randn({4, 24}, gen);
        ASSERT_TRUE(testing::differs_across_ranks(c, *g));
        at::Tensor exact_w = at::zeros({24, 5}), exact_b = at::zeros({24});
        for (const auto& t : testing::everyones(*g, at::cat({c.t().mm(x).reshape(-1), c.sum(0)}))) {
          exact_w += t.narrow(0, 0, 120).reshape({24, 5}) / world;
          exact_b += t.narrow(0, 120, 24) / world;
        }
        double off[2] = {0, 0};
        for (int feedback : {0, 1}) {
          torch::nn::Linear net(5, 24);
          {
            at::NoGradGuard no_grad;
            net->weight.copy_(at::randn({24, 5}, at::make_generator<at::CPUGeneratorImpl>(7)));
            net->bias.zero_();
          }
          const at::Tensor w0 = net->weight.detach().clone(), b0 = net->bias.detach().clone();
          OSS oss(net->parameters(), optimizer<optim::SGD>(optim::SGDOptions(kLr)), g);
          ShardedDDP ddp(net, oss, ShardedDDPOptions().gradient_wire(wire).error_feedback(feedback != 0));
          for (int step = 0; step < kSteps; ++step) {
            ddp.zero_grad();
            (ddp.forward(x) * c).sum().backward();
            oss.step();
          }
          const double scale = kLr * kSteps;
          off[feedback] = std::max(((w0 - net->weight.detach()) / scale - exact_w).abs().max().item<double>(),
                                   ((b0 - net->bias.detach()) / scale - exact_b).abs().max().item<double>());
        }
        EXPECT_GT(off[0], 1e-4) << "the plain wire rounded (almost) nothing";
        EXPECT_LT(10 * off[1], off[0]) << "mean update off the exact mean gradient by " << off[1]
                                       << " with error feedback, " << off[0] << " without";
      });
    }
  }
}

TEST(GradientWire, AWireThatDiffersBetweenRanksOrBf16OverFp16IsAnErrorOnEveryRank) {
  auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g);
    ShardedDDP ddp(net.ptr(), oss,
                   ShardedDDPOptions().gradient_wire(g->rank() == 0 ? Wire::kExact : Wire::kBFloat16));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("ShardedDDPOptions::gradient_wire differs between ranks: rank 0 has exact, rank 1 has bf16"),
              std::string::npos)
        << e;
  }
  errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g);
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().gradient_wire(g->rank() == 0 ? Wire::kInt8 : Wire::kBFloat16));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("gradient_wire differs between ranks: rank 0 has int8, rank 1 has bf16"), std::string::npos) << e;
  }
  // Gradients reduced in fp16 would lose precision on a bf16 wire without saving a byte.
  errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g,
            OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kHalf)));
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().gradient_wire(Wire::kBFloat16));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("gradient_wire(Wire::kBFloat16) with gradients reduced in Half"), std::string::npos) << e;
  }
  // Error feedback on the exact wire, and on some ranks only.
  errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g);
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().error_feedback(true));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("error_feedback(true) needs a compressed gradient_wire"), std::string::npos) << e;
  }
  errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = net_of(7);
    OSS oss(net->parameters(), optimizer<optim::AdamW>(adamw()), g);
    ShardedDDP ddp(net.ptr(), oss, ShardedDDPOptions().gradient_wire(Wire::kBFloat16).error_feedback(g->rank() == 1));
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("error_feedback differs between ranks: rank 0 has false, rank 1 has true"), std::string::npos) << e;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
