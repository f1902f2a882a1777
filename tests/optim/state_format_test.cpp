// OSSOptions::state_format (Note [State formats] in csrc/optim/state_slabs.cpp). With kBFloat16
// the owners keep Adam's, AdamW's and SGD's state in bf16: checked against a single-process
// reference written here with ATen's own arithmetic (fp32 moments, rounded to bf16 after each
// step), the same bits at worlds 1 to 4 and 16 with split rows and whole parameters through a
// freeze, an unfreeze and a re-partition, half the state's bytes, a consolidated state dict in
// fp32 that PyTorch's layout expects and that loads back to the same bits, and bad options refused
// on every rank.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/mixed_precision.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"
#include "named_net.h"

#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/rmsprop.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/api/include/torch/serialize.h>

#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using Params = std::vector<at::Tensor>;

constexpr double kLr = 1e-3, kWeightDecay = 0.01;
constexpr int kSteps = 8;

// Tensors of several sizes: two over the 256-element blocks of the bf16 loops, one not a
// multiple of them, one small.
Params make_params(at::ScalarType dtype = at::kFloat) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Params out;
  for (const auto& sizes : std::vector<std::vector<int64_t>>{{37, 29}, {1031}, {64, 48}, {7}}) {
    out.push_back(at::randn(sizes, gen).to(dtype).set_requires_grad(true));
  }
  return out;
}

// The gradient of parameter i at `step`: the same on every rank (what OSS steps after the
// all-reduce), different per step and parameter.
at::Tensor grad_of(size_t i, int step, const at::Tensor& p) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * static_cast<uint64_t>(step) + i);
  return at::randn(p.sizes(), gen) * (0.1 + 0.05 * static_cast<double>(i));
}

// Parameter 0 is frozen for steps 3 and 4 and trains again from step 5.
bool frozen_at(size_t i, int step) { return i == 0 && (step == 3 || step == 4); }

// AdamW with fp32 arithmetic and its two moments kept in bf16 (rounded to nearest even after
// each step), written with ATen's operators: independent of the fused loops.
struct Bf16AdamWReference {
  Params params;
  std::map<size_t, std::pair<at::Tensor, at::Tensor>> moments;  // bf16
  std::map<size_t, int64_t> steps;

  void step(size_t i, const at::Tensor& g) {
    at::NoGradGuard no_grad;
    at::Tensor& p = params[i];
    auto [it, fresh] = moments.try_emplace(i);
    if (fresh) {
      it->second = {at::zeros(p.sizes(), at::kBFloat16), at::zeros(p.sizes(), at::kBFloat16)};
    }
    const int64_t t = ++steps[i];
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    p.mul_(1 - kLr * kWeightDecay);
    const at::Tensor m = it->second.first.to(at::kFloat) * b1 + g * (1 - b1);
    const at::Tensor v = it->second.second.to(at::kFloat) * b2 + g * g * (1 - b2);
    const at::Tensor denom = v.sqrt() / std::sqrt(1 - std::pow(b2, t)) + eps;
    p.sub_(m / denom * (kLr / (1 - std::pow(b1, t))));
    it->second = {m.to(at::kBFloat16), v.to(at::kBFloat16)};
  }
};

OSSOptions bf16_options(PartitionMode partition) {
  return OSSOptions().partition(partition).state_format(StateFormat::kBFloat16);
}

// Runs kSteps of AdamW under OSS at `world` (freezing parameter 0 for two steps) and returns
// rank 0's final parameters (every rank holds the same after the sync).
Params train(int world, const OSSOptions& options) {
  Params out;
  std::mutex mu;
  testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr).weight_decay(kWeightDecay)), g, options);
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].requires_grad_(!frozen_at(i, step));
        params[i].mutable_grad() = frozen_at(i, step) ? at::Tensor() : grad_of(i, step, params[i]);
      }
      oss.step();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (g->rank() == 0) {
      for (const auto& p : params) out.push_back(p.detach().clone());
    }
  });
  return out;
}

void expect_bitwise_equal(const Params& a, const Params& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << what << ", parameter " << i;
}

TEST(StateFormat, Bf16AdamWFollowsAReferenceThatRoundsItsMomentsThroughAFreeze) {
  Bf16AdamWReference ref{make_params(), {}, {}};
  for (auto& p : ref.params) p = p.detach().clone();
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < ref.params.size(); ++i) {
      if (!frozen_at(i, step)) ref.step(i, grad_of(i, step, ref.params[i]));
    }
  }
  const Params bf16 = train(2, bf16_options(PartitionMode::kSplit));
  const Params fp32 = train(2, OSSOptions().partition(PartitionMode::kSplit));
  ASSERT_EQ(bf16.size(), ref.params.size());
  double from_ref = 0, from_fp32 = 0;
  for (size_t i = 0; i < bf16.size(); ++i) {
    from_ref = std::max(from_ref, (bf16[i] - ref.params[i]).abs().max().item<double>());
    from_fp32 = std::max(from_fp32, (bf16[i] - fp32[i]).abs().max().item<double>());
  }
  // The fused loops' fmadd against ATen's separate multiply and add: fp32 rounding, which now and
  // then moves a moment to the next bf16 value (2^-8 of it, times the learning rate).
  EXPECT_LE(from_ref, 2e-5);
  // bf16 moments change the result: rounding them is not a no-op.
  EXPECT_GT(from_fp32, 10 * from_ref) << "bf16 state gave the fp32 state's parameters";
}

TEST(StateFormat, Bf16StateGivesTheSameBitsAtEveryWorldSizeAndPartition) {
  const Params at_one = train(1, bf16_options(PartitionMode::kSplit));
  for (const PartitionMode partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    for (int world : {2, 3, 4, 16}) {
      const std::string what = "world " + std::to_string(world) +
                               (partition == PartitionMode::kSplit ? ", split rows" : ", whole parameters");
      expect_bitwise_equal(at_one, train(world, bf16_options(partition)), what);
    }
  }
}

TEST(StateFormat, Bf16StateHoldsHalfTheBytesAndItsStateDictIsFp32AndLoadsBackToTheSameBits) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto run = [&](const OSSOptions& options, Params& params) {
      auto oss = std::make_unique<OSS>(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, options);
      for (int step = 0; step < 3; ++step) {
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, step, params[i]);
        oss->step();
      }
      return oss;
    };
    Params p32 = make_params(), p16 = make_params();
    auto fp32 = run(OSSOptions(), p32);
    auto bf16 = run(bf16_options(PartitionMode::kAuto), p16);
    EXPECT_EQ(bf16->local_state_bytes() * 2, fp32->local_state_bytes()) << "rank " << g->rank();
    EXPECT_GT(bf16->local_state_bytes(), 0);

    bf16->consolidate_state_dict(0);
    c10::IValue saved = g->rank() == 0 ? bf16->state_dict() : c10::IValue();
    // Every rank loads rank 0's dict (sent as bytes) into a fresh OSS over copies of the parameters.
    Params copies;
    for (const auto& p : p16) copies.push_back(p.detach().clone().set_requires_grad(true));
    auto loaded = std::make_unique<OSS>(copies, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
                                        bf16_options(PartitionMode::kAuto));
    std::vector<char> bytes;
    if (g->rank() == 0) {
      const auto state = saved.toGenericDict().at("state").toGenericDict();
      ASSERT_EQ(state.size(), p16.size());
      for (const auto& entry : state) {
        for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
          const at::Tensor t = entry.value().toGenericDict().at(kind).toTensor();
          EXPECT_EQ(t.scalar_type(), at::kFloat) << kind << " of parameter " << entry.key().toInt();
          EXPECT_TRUE(t.equal(t.to(at::kBFloat16).to(at::kFloat))) << kind << ": not bf16 values, widened";
        }
      }
      bytes = torch::pickle_save(saved);
    }
    loaded->load_state_dict(torch::pickle_load(testing::broadcast_bytes(bytes, *g)));
    EXPECT_EQ(loaded->local_state_bytes(), bf16->local_state_bytes());
    for (int step = 3; step < 6; ++step) {
      for (size_t i = 0; i < p16.size(); ++i) {
        p16[i].mutable_grad() = grad_of(i, step, p16[i]);
        copies[i].mutable_grad() = grad_of(i, step, copies[i]);
      }
      bf16->step();
      loaded->step();
    }
    for (size_t i = 0; i < p16.size(); ++i) {
      EXPECT_TRUE(p16[i].equal(copies[i])) << "rank " << g->rank() << ", parameter " << i;
    }
  });
}

TEST(StateFormat, Bf16SgdMomentumFollowsAReferenceThatRoundsItsBuffer) {
  constexpr double kMomentum = 0.9;
  Params ref = make_params();
  for (auto& p : ref) p = p.detach().clone();
  std::map<size_t, at::Tensor> buf;  // bf16
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      const at::Tensor g = grad_of(i, step, ref[i]) + kWeightDecay * ref[i];
      const at::Tensor b = buf.count(i) ? buf[i].to(at::kFloat) * kMomentum + g : g;
      ref[i].sub_(b * kLr);
      buf[i] = b.to(at::kBFloat16);
    }
  }
  Params got;
  testing::run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    OSS oss(params, optimizer<optim::SGD>(optim::SGDOptions(kLr).momentum(kMomentum).weight_decay(kWeightDecay)), g,
            bf16_options(PartitionMode::kSplit));
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, step, params[i]);
      oss.step();
    }
    if (g->rank() == 1) got = params;
  });
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    EXPECT_LE((got[i] - ref[i]).abs().max().item<double>(), 1e-6) << "parameter " << i;
  }
}

// Under mixed precision (bf16 parameters, each rank its own data through ShardedDDP) the masters
// stay fp32 and only the moments are bf16: half the state's bytes, and the consolidated dict's
// masters are fp32 values whose bf16 rounding is the model.
TEST(StateFormat, Bf16StateUnderMixedPrecisionKeepsTheMastersFp32) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    std::map<StateFormat, int64_t> state_bytes;
    for (const StateFormat format : {StateFormat::kFloat32, StateFormat::kBFloat16}) {
      auto net = std::make_shared<testing::NamedNet>();
      OSS oss(net->parameters(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
              OSSOptions().state_format(format).mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
      ShardedDDP ddp(net, oss);
      for (int step = 0; step < 3; ++step) {
        const auto data = testing::rank_data(step, g->rank(), 3);
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 3).backward();
        oss.step();
      }
      state_bytes[format] = oss.local_state_bytes();
      oss.consolidate_state_dict(0);
      if (g->rank() != 0 || format != StateFormat::kBFloat16) continue;
      const auto saved = oss.state_dict().toGenericDict();
      const auto masters = saved.at("master_weights").toGenericDict();
      for (size_t i = 0; i < net->params.size(); ++i) {
        const at::Tensor m = masters.at(static_cast<int64_t>(i)).toTensor();
        EXPECT_EQ(m.scalar_type(), at::kFloat) << "master " << i;
        EXPECT_TRUE(m.to(at::kBFloat16).equal(net->params[i].detach())) << "master " << i;
        const auto state = saved.at("state").toGenericDict().at(static_cast<int64_t>(i)).toGenericDict();
        EXPECT_EQ(state.at("exp_avg").toTensor().scalar_type(), at::kFloat) << "parameter " << i;
      }
    }
    EXPECT_GT(state_bytes[StateFormat::kBFloat16], 0);
    EXPECT_EQ(state_bytes[StateFormat::kBFloat16] * 2, state_bytes[StateFormat::kFloat32]) << "rank " << g->rank();
  });
}

TEST(StateFormat, WhatBf16StateCannotHoldIsRefusedOnEveryRankNamingIt) {
  auto refused = [](const std::function<void(std::shared_ptr<ProcessGroup>)>& make, const std::string& needle) {
    const auto errors = testing::run_ranks_collect_errors(2, make);
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << ": " << errors[r];
    }
  };
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::RMSprop>(optim::RMSpropOptions(kLr)), g, bf16_options(PartitionMode::kAuto));
  }, "OSSOptions::state_format(bf16): param group 0's optimizer is torch::optim::RMSprop");
  refused([](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    std::vector<OptimizerGroup> groups;
    groups.push_back({{params[2]}, optimizer<Muon>(MuonOptions(0.02))});
    groups.push_back({{params[0], params[1], params[3]}, optimizer<optim::AdamW>(optim::AdamWOptions(kLr))});
    OSS oss(std::move(groups), g, bf16_options(PartitionMode::kAuto));
  }, "param group 0's optimizer is shardopt::Muon");
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(at::kDouble), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
            bf16_options(PartitionMode::kAuto));
  }, "parameter 0 is Double; this format holds the state of fp32 parameters");
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
            bf16_options(PartitionMode::kAuto).fused_step(false));
  }, "OSSOptions::state_format(bf16) needs the fused step");
  // Ranks that pass different formats: every rank names the option and both ranks' values.
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
            OSSOptions().state_format(g->rank() == 0 ? StateFormat::kFloat32 : StateFormat::kBFloat16));
  }, "state_format");
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
