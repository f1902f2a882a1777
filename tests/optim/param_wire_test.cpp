// OSSOptions::param_wire (Note [Parameter wire] in csrc/comm/wire.cpp): with kBFloat16 the
// owners step fp32 masters and every rank's fp32 parameters are the masters rounded to bf16.
// Checked against a single-process reference that keeps fp32 masters, steps them with plain
// torch::optim::Adam, and runs forward and backward on their bf16-rounded copies: through a
// freeze and clipping, at worlds 2 to 4, with row buckets, whole parameters (broadcasts or
// all-gathers), hierarchical sharding and the overlapped sync (of whole parameters' broadcasts and
// of row buckets packed from the masters), each rank's data different. The
// sync moves half the bytes of the exact wire, a resumed run goes on from the exact masters, and
// bad options are errors on every rank.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"
#include "optim/master_recipe.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;
using Net = testing::NamedNet;
using testing::consolidated_masters;

constexpr double kLr = 1e-2;

OptimizerFactory adam() { return optimizer<optim::Adam>(optim::AdamOptions(kLr)); }

bool bf16_representable(const at::Tensor& t) { return t.equal(t.to(at::kBFloat16).to(at::kFloat)); }

struct Case {
  int world;
  PartitionMode partition;
  ParamSync sync = ParamSync::kBroadcast;
  int shard_group_size = 0;
  bool overlap_sync = false;
};

std::string describe(const Case& c) {
  return "world " + std::to_string(c.world) + (c.partition == PartitionMode::kSplit ? ", row buckets" : ", whole") +
         (c.sync == ParamSync::kAllgather ? ", all-gathered" : "") + ", shard_group_size " +
         std::to_string(c.shard_group_size) + (c.overlap_sync ? ", overlapped sync" : "");
}

TEST(ParamWire, Bf16ParametersAreTheRoundedMastersOfTheRecipeThroughAFreeze) {
  for (const Case& c : {Case{2, PartitionMode::kSplit}, Case{3, PartitionMode::kWholeParameters},
                        Case{3, PartitionMode::kWholeParameters, ParamSync::kAllgather},
                        Case{4, PartitionMode::kSplit, ParamSync::kBroadcast, /*shard_group_size=*/2},
                        Case{2, PartitionMode::kWholeParameters, ParamSync::kBroadcast, 0, /*overlap_sync=*/true},
                        Case{3, PartitionMode::kSplit, ParamSync::kBroadcast, 0, /*overlap_sync=*/true}}) {
    SCOPED_TRACE(describe(c));
    testing::run_ranks(c.world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g,
              OSSOptions().partition(c.partition).sync(c.sync).shard_group_size(c.shard_group_size).param_wire(
                  Wire::kBFloat16));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64).overlap_param_sync(c.overlap_sync));
      testing::MasterRecipe ref(at::kFloat, at::kFloat, c.world, kLr, at::kBFloat16);
      for (int step = 0; step < 6; ++step) {
        const bool freeze = step == 2 || step == 3;
        net->params[2].requires_grad_(!freeze);
        net->params[3].requires_grad_(!freeze);
        const auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.clip_grad_norm(0.5);
        oss.step();
        ddp.finish_param_sync();
        ref.step(step, {false, false, freeze, freeze, false}, 0.5);
        for (size_t i = 0; i < ref.master.size(); ++i) {
          ASSERT_EQ(net->params[i].scalar_type(), at::kFloat) << "the parameters stay fp32";
          EXPECT_TRUE(bf16_representable(net->params[i])) << "step " << step << " parameter " << i;
          // The rounded masters, one bf16 step apart at most where fp32 sums differ in their last
          // bit.
          EXPECT_LE(testing::rel_diff(net->params[i], ref.copy_of(i)), 1e-2) << "step " << step << " parameter " << i;
        }
        ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g)) << "step " << step;
        const Params masters = consolidated_masters(oss, ref.master.size());
        for (size_t i = 0; i < masters.size(); ++i) {
          ASSERT_EQ(masters[i].scalar_type(), at::kFloat);
          EXPECT_LE(testing::rel_diff(masters[i], ref.master[i]), 1e-4) << "step " << step << " master " << i;
          // Every rank's parameter is its master rounded, bit for bit.
          EXPECT_TRUE(net->params[i].equal(masters[i].to(at::kBFloat16).to(at::kFloat))) << "step " << step << " " << i;
        }
      }
      // The masters carry what bf16 cannot hold.
      const Params masters = consolidated_masters(oss, ref.master.size());
      if (g->rank() == 0) EXPECT_GT(testing::rel_diff(masters[0], net->params[0]), 1e-5);
    });
  }
}

// The bytes the parameter sync of one step moves on rank 0 (all-gathers and broadcasts).
int64_t sync_bytes(int world, PartitionMode partition, Wire wire) {
  int64_t bytes = 0;
  testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g, OSSOptions().partition(partition).param_wire(wire));
    ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64));
    const auto data = testing::rank_data(0, g->rank(), 3);
    testing::loss_of(ddp.forward(data.x), data, 3).backward();
    const CommStats before = g->stats();
    oss.step();
    const CommStats& after = g->stats();
    if (g->rank() == 0) {
      bytes = after.bytes[CommStats::kAllgather] - before.bytes[CommStats::kAllgather] +
              after.bytes[CommStats::kBroadcast] - before.bytes[CommStats::kBroadcast];
    }
  });
  return bytes;
}

// kInt8 (Note [Int8 wire]): every rank holds the same parameters, each within half a step of its
// block of the owner's fp32 master (at most max |master| / 254), through a freeze.
TEST(ParamWire, Int8ParametersAreTheDequantisedMastersOnEveryRank) {
  for (const Case& c : {Case{2, PartitionMode::kSplit}, Case{3, PartitionMode::kWholeParameters},
                        Case{4, PartitionMode::kSplit}}) {
    SCOPED_TRACE(describe(c));
    testing::run_ranks(c.world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g, OSSOptions().partition(c.partition).param_wire(Wire::kInt8));
      ShardedDDP ddp(net, oss, ShardedDDPOptions().reduce_bucket_bytes(64));
      for (int step = 0; step < 5; ++step) {
        const bool freeze = step == 2;
        net->params[2].requires_grad_(!freeze);
        const auto data = testing::rank_data(step, g->rank(), 3);
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.step();
        ASSERT_TRUE(testing::same_on_all_ranks(net->params, *g)) << "step " << step;
        const Params masters = consolidated_masters(oss, net->params.size());
        double largest = 0, off = 0;
        for (size_t i = 0; i < masters.size(); ++i) {
          largest = std::max(largest, masters[i].abs().max().item<double>());
          off = std::max(off, (net->params[i] - masters[i]).abs().max().item<double>());
        }
        if (g->rank() == 0) {
          EXPECT_LE(off, largest / 254 * 1.0001) << "step " << step;
          EXPECT_GT(off, 0) << "step " << step << ": int8 rounded nothing";
        }
      }
    });
  }
}

// Under bf16 mixed precision (docs/api.md's table of wires and mixed precision): bf16 wires on the
// gradients and the parameters are what the exact path already does, bit for bit, step by step,
// through a freeze; and int8 parameters are the owners' fp32 masters dequantised, then rounded to
// the bf16 parameters, the same on every rank. Two models on the same data, each rank's different.
TEST(ParamWire, UnderBf16MixedPrecisionBf16WiresChangeNothingAndInt8ParametersAreTheMasters) {
  const auto bf16 = MixedPrecision().param_dtype(at::kBFloat16);
  for (int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto exact_net = std::make_shared<Net>(), wired_net = std::make_shared<Net>(), int8_net = std::make_shared<Net>();
      OSS exact(exact_net->parameters(), adam(), g, OSSOptions().mixed_precision(bf16));
      OSS wired(wired_net->parameters(), adam(), g, OSSOptions().mixed_precision(bf16).param_wire(Wire::kBFloat16));
      OSS int8(int8_net->parameters(), adam(), g, OSSOptions().mixed_precision(bf16).param_wire(Wire::kInt8));
      ShardedDDP exact_ddp(exact_net, exact);
      ShardedDDP wired_ddp(wired_net, wired, ShardedDDPOptions().gradient_wire(Wire::kBFloat16));
      ShardedDDP int8_ddp(int8_net, int8, ShardedDDPOptions().gradient_wire(Wire::kInt8));
      for (int step = 0; step < 5; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        for (auto* net : {exact_net.get(), wired_net.get(), int8_net.get()}) net->params[2].requires_grad_(step != 2);
        for (auto* ddp : {&exact_ddp, &wired_ddp, &int8_ddp}) {
          ddp->zero_grad();
          testing::loss_of(ddp->forward(data.x.to(at::kBFloat16)).to(at::kFloat), data, 3).backward();
        }
        exact.step();
        wired.step();
        int8.step();
        for (size_t i = 0; i < exact_net->params.size(); ++i) {
          ASSERT_EQ(wired_net->params[i].scalar_type(), at::kBFloat16);
          ASSERT_TRUE(wired_net->params[i].equal(exact_net->params[i])) << "parameter " << i << ", step " << step;
        }
        ASSERT_TRUE(testing::same_on_all_ranks(int8_net->params, *g)) << "step " << step;
        // The exact path's parameters are its masters rounded to bf16.
        const Params exact_masters = consolidated_masters(exact, exact_net->params.size());
        const Params masters = consolidated_masters(int8, int8_net->params.size());
        if (g->rank() != 0) continue;
        for (size_t i = 0; i < exact_masters.size(); ++i) {
          EXPECT_TRUE(exact_net->params[i].equal(exact_masters[i].to(at::kBFloat16))) << "parameter " << i;
        }
        double largest = 0;
        for (const auto& m : masters) largest = std::max(largest, m.abs().max().item<double>());
        bool rounded = false;
        for (size_t i = 0; i < masters.size(); ++i) {
          // The master rounded to the bf16 parameter (half a bf16 ulp, at most |m| / 256), that
          // quantised (half an int8 step of its block, at most max |block| / 254), and the
          // dequantised value rounded to bf16 again (half an ulp of a value at most |m| plus that).
          const at::Tensor off = (int8_net->params[i].to(at::kFloat) - masters[i]).abs();
          const double step_half = largest * (1 + 1.0 / 256) / 254;
          const at::Tensor bound = (step_half + (masters[i].abs() * (2 + 1.0 / 256) + step_half) / 256) * 1.0001;
          EXPECT_TRUE(off.le(bound).all().item<bool>())
              << "parameter " << i << ", step " << step << ": off by up to " << (off - bound).max().item<double>()
              << " beyond the bound";
          rounded = rounded || !int8_net->params[i].equal(masters[i].to(at::kBFloat16));
        }
        EXPECT_TRUE(rounded) << "step " << step << ": int8 rounded nothing beyond bf16";
      }
    });
  }
}

// Only what travels is rounded (api.md, "param_wire"): under a bf16 wire the parameters keep their
// fp32 values at construction; a parameter frozen from the start keeps them through steps at world
// 2; and at world 1, where nothing travels, the steps leave values no bf16 holds.
TEST(ParamWire, OnlyWhatTravelsIsRounded) {
  for (int world : {1, 2}) {
    testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      const Params initial = testing::clone_params(net->params);
      ASSERT_FALSE(bf16_representable(initial[0])) << "the test needs fp32 values bf16 does not hold";
      net->params[0].requires_grad_(false);  // frozen from the start
      OSS oss(net->parameters(), adam(), g, OSSOptions().param_wire(Wire::kBFloat16));
      for (size_t i = 0; i < initial.size(); ++i) {
        EXPECT_TRUE(net->params[i].equal(initial[i])) << "world " << world << ": parameter " << i << " at construction";
      }
      ShardedDDP ddp(net, oss);
      for (int step = 0; step < 3; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.step();
      }
      EXPECT_TRUE(net->params[0].equal(initial[0])) << "world " << world << ": the parameter frozen from the start";
      if (world == 1) {
        for (size_t i = 1; i < initial.size(); ++i) {
          EXPECT_FALSE(net->params[i].equal(initial[i])) << "parameter " << i << " did not train";
          EXPECT_FALSE(bf16_representable(net->params[i])) << "world 1: parameter " << i << " was rounded to bf16";
        }
      } else {
        for (size_t i = 1; i < initial.size(); ++i) {
          EXPECT_TRUE(bf16_representable(net->params[i])) << "world 2: parameter " << i << " travelled unrounded";
        }
      }
    });
  }
}

TEST(ParamWire, Bf16SyncMovesHalfTheBytes) {
  for (int world : {2, 3, 4}) {
    for (PartitionMode partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
      SCOPED_TRACE("world " + std::to_string(world) + (partition == PartitionMode::kSplit ? ", rows" : ", whole"));
      const int64_t exact = sync_bytes(world, partition, Wire::kExact);
      EXPECT_GT(exact, 0);
      EXPECT_EQ(2 * sync_bytes(world, partition, Wire::kBFloat16), exact);
      // int8: a byte an element and 4 a block of 256; this model's ranges are shorter than a block,
      // so each pays a whole scale.
      const int64_t int8 = sync_bytes(world, partition, Wire::kInt8);
      EXPECT_GT(4 * int8, exact);
      EXPECT_LT(int8, exact * 0.35) << int8 << " of " << exact;
    }
  }
}

// Six steps at world 2, or three, a state dict, a new OSS over the module's (rounded) parameters
// loading it, and three more: the same bits, because the state dict carries the exact masters.
TEST(ParamWire, AResumedRunGoesOnFromTheExactMasters) {
  auto train = [](ProcessGroup& g, const std::shared_ptr<Net>& net, ShardedDDP& ddp, OSS& oss, int from, int to) {
    for (int step = from; step < to; ++step) {
      const auto data = testing::rank_data(step, g.rank(), 3);
      ddp.zero_grad();
      testing::loss_of(ddp.forward(data.x), data, 3).backward();
      oss.step();
    }
  };
  Params straight, resumed, saved_params;
  c10::IValue saved;
  const auto options = OSSOptions().param_wire(Wire::kBFloat16);
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g, options);
    ShardedDDP ddp(net, oss);
    train(*g, net, ddp, oss, 0, 3);
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      saved = oss.state_dict();
      saved_params = testing::clone_params(net->params);
    }
    train(*g, net, ddp, oss, 3, 6);
    if (g->rank() == 0) straight = testing::clone_params(net->params);
  });
  ASSERT_TRUE(saved.toGenericDict().contains("master_weights"));
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < net->params.size(); ++i) net->params[i].copy_(saved_params[i]);
    }
    OSS oss(net->parameters(), adam(), g, options);
    oss.load_state_dict(saved);
    ShardedDDP ddp(net, oss);
    train(*g, net, ddp, oss, 3, 6);
    if (g->rank() == 0) resumed = testing::clone_params(net->params);
  });
  ASSERT_EQ(straight.size(), resumed.size());
  int64_t moved = 0;
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_TRUE(straight[i].equal(resumed[i])) << "parameter " << i;
    moved += straight[i].ne(saved_params[i]).sum().item<int64_t>();
  }
  EXPECT_GT(moved, 0) << "the last three steps changed nothing";
}

TEST(ParamWire, BadOptionsAreErrorsOnEveryRank) {
  auto errors_of = [](const std::function<OSSOptions(int rank)>& options) {
    return testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      OSS oss(testing::make_params(), adam(), g, options(g->rank()));
    });
  };
  for (const auto& e : errors_of([](int r) { return OSSOptions().param_wire(r == 0 ? Wire::kExact : Wire::kInt8); })) {
    EXPECT_NE(e.find("param_wire"), std::string::npos) << e;
    EXPECT_NE(e.find("int8"), std::string::npos) << e;
  }
  for (const auto& e : errors_of([](int r) { return OSSOptions().param_wire(r == 0 ? Wire::kExact : Wire::kBFloat16); })) {
    EXPECT_NE(e.find("param_wire"), std::string::npos) << e;
    EXPECT_NE(e.find("exact"), std::string::npos) << e;
    EXPECT_NE(e.find("bf16"), std::string::npos) << e;
  }
  for (const auto& e : errors_of([](int) {
         return OSSOptions().param_wire(Wire::kBFloat16).mixed_precision(MixedPrecision().param_dtype(at::kHalf));
       })) {
    EXPECT_NE(e.find("param_dtype(kHalf)"), std::string::npos) << e;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
