// OSSOptions::state_format(StateFormat::kInt8) (Note [8-bit state slabs] in
// csrc/optim/state_slabs.cpp): the owners keep Adam's, AdamW's and SGD's moments of tensors of at
// least 4,096 elements in 8-bit blockwise codes. Checked against a single-process reference
// written here with ATen's operators (nearest map value by search, one absmax per 256 elements of
// the whole tensor), against torchao 0.18's AdamW8bit through OSS, for the same bits at worlds 1
// to 4 and 16 with split rows and whole parameters through a freeze, an unfreeze and a
// re-partition, for codes and scales being what is kept (the state's bytes), for a consolidated
// state dict in fp32 that loads back to the same codes, at another world size, and for what it
// cannot hold being refused on every rank.
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/grad_scaler.h>
#include <shardopt/optim/mixed_precision.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>
#include <shardopt/optim/state_layout.h>
#include <shardopt/compat.h>

#include "optim/state_codes.h"

#include "harness.h"
#include "model.h"
#include "named_net.h"

#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/api/include/torch/optim/rmsprop.h>
#include <torch/csrc/api/include/torch/optim/sgd.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
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

// Tensors that are coded (a multiple of the block, one with a short last block, one over several
// rows of 16 ranks) and two small ones that keep fp32 state.
Params make_params() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  Params out;
  for (const auto& sizes : std::vector<std::vector<int64_t>>{{64, 80}, {4099}, {37, 29}, {96, 64}, {7}}) {
    out.push_back(at::randn(sizes, gen).set_requires_grad(true));
  }
  return out;
}

// The gradient of parameter i at `step`: the same on every rank (what OSS steps after the
// all-reduce), different per step and parameter, with a spread of magnitudes within each tensor.
at::Tensor grad_of(size_t i, int step, const at::Tensor& p) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * static_cast<uint64_t>(step) + i);
  return at::randn(p.sizes(), gen) * at::exp(at::randn(p.sizes(), gen)) * (0.1 + 0.05 * static_cast<double>(i));
}

// Parameter 0 is frozen for steps 3 and 4 and trains again from step 5.
bool frozen_at(size_t i, int step) { return i == 0 && (step == 3 || step == 4); }

// Blockwise 8-bit codes written with ATen's operators: each block of 256 elements of the whole
// tensor divided by its absolute maximum, each value the nearest entry of the map (a search over
// all 256), independent of the fused loops' tables.
struct ReferenceCodes {
  at::Tensor codes, scales;

  static ReferenceCodes of(const at::Tensor& x, bool is_signed) {
    const auto& m = detail::dynamic_map(is_signed);
    const at::Tensor map = at::from_blob(const_cast<float*>(m.data()), {256}, at::kFloat).clone();
    const int64_t n = x.numel(), blocks = detail::state_blocks(n);
    at::Tensor padded = at::zeros({blocks * detail::kStateBlock});
    padded.narrow(0, 0, n).copy_(x.reshape(-1));
    const at::Tensor rows = padded.view({blocks, detail::kStateBlock});
    const at::Tensor scales = rows.abs().amax(1).clamp_min(1e-12);
    const at::Tensor normed = rows / scales.unsqueeze(1);
    const at::Tensor codes = (normed.unsqueeze(-1) - map).abs().argmin(-1).reshape(-1).narrow(0, 0, n);
    return {codes, scales};
  }
  at::Tensor decoded(bool is_signed) const {
    const auto& m = detail::dynamic_map(is_signed);
    const at::Tensor map = at::from_blob(const_cast<float*>(m.data()), {256}, at::kFloat);
    const at::Tensor each = scales.repeat_interleave(detail::kStateBlock).narrow(0, 0, codes.numel());
    return map.index({codes}) * each;
  }
};

// AdamW with fp32 arithmetic whose moments of coded tensors are kept as reference codes between
// steps (smaller tensors: fp32), written with ATen's operators.
struct Int8AdamWReference {
  Params params;
  std::map<size_t, std::pair<at::Tensor, at::Tensor>> moments;  // decoded values
  std::map<size_t, int64_t> steps;

  void step(size_t i, const at::Tensor& g) {
    at::NoGradGuard no_grad;
    at::Tensor& p = params[i];
    auto [it, fresh] = moments.try_emplace(i);
    if (fresh) it->second = {at::zeros({p.numel()}), at::zeros({p.numel()})};
    const int64_t t = ++steps[i];
    const double b1 = 0.9, b2 = 0.999, eps = 1e-8;
    const at::Tensor flat = g.reshape(-1);
    p.mul_(1 - kLr * kWeightDecay);
    const at::Tensor m = it->second.first * b1 + flat * (1 - b1);
    const at::Tensor v = it->second.second * b2 + flat * flat * (1 - b2);
    const at::Tensor denom = v.sqrt() / std::sqrt(1 - std::pow(b2, t)) + eps;
    p.sub_((m / denom * (kLr / (1 - std::pow(b1, t)))).view(p.sizes()));
    if (detail::coded_numel(p.numel())) {
      it->second = {ReferenceCodes::of(m, true).decoded(true), ReferenceCodes::of(v, false).decoded(false)};
    } else {
      it->second = {m, v};
    }
  }
};

OSSOptions int8_options(PartitionMode partition) {
  return OSSOptions().partition(partition).state_format(StateFormat::kInt8);
}

// Runs kSteps under the OSS `make` builds over each rank's parameters at `world` (freezing
// parameter 0 for two steps) and returns rank 0's final parameters (every rank holds the same
// after the sync).
using MakeOSS = std::function<std::unique_ptr<OSS>(Params&, std::shared_ptr<ProcessGroup>)>;
using Schedule = std::function<bool(size_t param, int step)>;  // whether a parameter is frozen at a step

Params train_with(int world, const MakeOSS& make, const Schedule& frozen = frozen_at) {
  Params out;
  std::mutex mu;
  testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    auto oss = make(params, g);
    for (int step = 0; step < kSteps; ++step) {
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].requires_grad_(!frozen(i, step));
        params[i].mutable_grad() = frozen(i, step) ? at::Tensor() : grad_of(i, step, params[i]);
      }
      oss->step();
    }
    std::lock_guard<std::mutex> lock(mu);
    if (g->rank() == 0) {
      for (const auto& p : params) out.push_back(p.detach().clone());
    }
  });
  return out;
}

// AdamW over every parameter.
Params train(int world, const OSSOptions& options, const Schedule& frozen = frozen_at) {
  return train_with(
      world,
      [&](Params& params, std::shared_ptr<ProcessGroup> g) {
        return std::make_unique<OSS>(params,
                                     optimizer<optim::AdamW>(optim::AdamWOptions(kLr).weight_decay(kWeightDecay)), g,
                                     options);
      },
      frozen);
}

double max_difference(const Params& a, const Params& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  return d;
}

void expect_bitwise_equal(const Params& a, const Params& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].equal(b[i])) << what << ", parameter " << i;
}

TEST(Int8State, AdamWFollowsABlockwiseReferenceThroughAFreeze) {
  Int8AdamWReference ref{make_params(), {}, {}};
  for (auto& p : ref.params) p = p.detach().clone();
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < ref.params.size(); ++i) {
      if (!frozen_at(i, step)) ref.step(i, grad_of(i, step, ref.params[i]));
    }
  }
  const Params int8 = train(2, int8_options(PartitionMode::kSplit));
  const Params fp32 = train(2, OSSOptions().partition(PartitionMode::kSplit));
  const double from_ref = max_difference(int8, ref.params), from_fp32 = max_difference(int8, fp32);
  RecordProperty("int8_to_reference", std::to_string(from_ref));
  RecordProperty("int8_to_fp32", std::to_string(from_fp32));
  // The fused loops' fmadd against ATen's separate multiply and add: now and then a moment lands
  // on the other side of a code's threshold.
  EXPECT_LT(from_ref, 0.1 * from_fp32) << "int8 to the reference " << from_ref << ", int8 to fp32 " << from_fp32;
  // The small tensors keep fp32 state: their parameters are fp32 AdamW's.
  for (const size_t small : {2, 4}) EXPECT_LE((int8[small] - fp32[small]).abs().max().item<double>(), 1e-6) << small;
}

TEST(Int8State, TheSameBitsAtEveryWorldSizeAndPartition) {
  const Params at_one = train(1, int8_options(PartitionMode::kSplit));
  for (const PartitionMode partition : {PartitionMode::kSplit, PartitionMode::kWholeParameters}) {
    for (int world : {2, 3, 4, 16}) {
      const std::string what = "world " + std::to_string(world) +
                               (partition == PartitionMode::kSplit ? ", split rows" : ", whole parameters");
      expect_bitwise_equal(at_one, train(world, int8_options(partition)), what);
    }
  }
  // Hierarchical sharding: replica groups of two blocks of two ranks.
  expect_bitwise_equal(at_one, train(4, int8_options(PartitionMode::kSplit).shard_group_size(2)), "world 4, blocks of 2");
}

// A parameter frozen from the start and unfrozen later (while another freezes) makes the trainable
// region outgrow its slabs' memory: the codes that stay on their rank are then copied into new
// slabs with their scales, some as slices of holdings assembled from several ranks' ranges (Note
// [State lands in its slot] in csrc/optim/state_migration.cpp), and the bits stay world 1's.
TEST(Int8State, AnUnfreezeThatOutgrowsTheSlabsKeepsTheBitsOfWorldOne) {
  const Schedule late = [](size_t i, int step) { return (i == 3 && step < 4) || (i == 0 && step >= 4); };
  const Params at_one = train(1, int8_options(PartitionMode::kSplit), late);
  for (int world : {2, 3}) {
    expect_bitwise_equal(at_one, train(world, int8_options(PartitionMode::kSplit), late),
                         "world " + std::to_string(world));
  }
}

// torchao 0.18's AdamW8bit and fp32 AdamW over the same parameters and gradients
// (tests/python/state_codes_reference.py adamw8), replayed through OSS at two ranks with kInt8.
TEST(Int8State, AdamWThroughOSSEndsFarNearerTorchaosAdamW8bitThanTorchaosEndsToFp32) {
  const std::string out = ::testing::TempDir() + "int8_state_adamw8_" + std::to_string(::getpid()) + ".pt";
  const std::string cmd = std::string(SHARDOPT_PYTHON_EXE) + " " + SHARDOPT_SOURCE_DIR +
                          "/tests/python/state_codes_reference.py adamw8 " + out;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::ifstream in(out, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::remove(out.c_str());
  const auto ref = torch::pickle_load(bytes).toGenericDict();
  auto tensors = [](const c10::IValue& list) {
    Params t;
    for (const auto& v : list.toListRef()) t.push_back(v.toTensor());
    return t;
  };
  std::vector<double> o;
  for (const auto& v : ref.at("options").toListRef()) o.push_back(v.toDouble());
  const Params init = tensors(ref.at("init")), torchao = tensors(ref.at("torchao")), fp32 = tensors(ref.at("fp32"));
  const auto steps = ref.at("grads").toListRef();
  Params ours;
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params params;
    for (const auto& p : init) params.push_back(p.clone().set_requires_grad(true));
    OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(o[0]).betas({o[1], o[2]}).eps(o[3]).weight_decay(o[4])),
            g, int8_options(PartitionMode::kSplit));
    for (const auto& step : steps) {
      const Params grads = tensors(step);
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i].clone();
      oss.step();
    }
    if (g->rank() == 1) ours = params;
  });
  const double ours_to_torchao = max_difference(ours, torchao), torchao_to_fp32 = max_difference(torchao, fp32);
  RecordProperty("ours_to_torchao", std::to_string(ours_to_torchao));
  RecordProperty("torchao_to_fp32", std::to_string(torchao_to_fp32));
  EXPECT_GT(torchao_to_fp32, 1e-4) << "8-bit state changed nothing in torchao";
  EXPECT_LT(ours_to_torchao, 0.05 * torchao_to_fp32) << "ours to torchao " << ours_to_torchao << ", torchao to fp32 "
                                                     << torchao_to_fp32;
}

// The state's bytes are the codes' and the scales' (a byte an element and 4 bytes a block for the
// coded tensors, 8 bytes an element for the small ones, Adam's two moments), not fp32 copies; the
// consolidated dict holds fp32 values that code to themselves; loading it at another world size
// codes it back to the same codes (the next steps are bit for bit those of the run that never
// stopped).
TEST(Int8State, KeepsCodesAndScalesAndItsStateDictIsFp32AndResumesAtAnotherWorldSize) {
  // The straight run at world 3, and what it saved after 3 steps.
  Params straight;
  std::vector<char> saved_bytes;
  std::mutex mu;
  auto step_all = [](Params& params, OSS& oss, int from, int to) {
    for (int step = from; step < to; ++step) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, step, params[i]);
      oss.step();
    }
  };
  testing::run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
    step_all(params, oss, 0, 3);
    // Every rank's bytes, from its own ranges of each parameter.
    const auto total = at::full({1}, oss.local_state_bytes(), at::kLong);
    at::Tensor sum = total.clone();
    g->allreduce(sum);
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      const auto state = oss.state_dict().toGenericDict().at("state").toGenericDict();
      EXPECT_EQ(state.size(), params.size());
      for (const auto& entry : state) {
        const at::Tensor& p = params[entry.key().toInt()];
        for (const char* kind : {"exp_avg", "exp_avg_sq"}) {
          const at::Tensor t = entry.value().toGenericDict().at(kind).toTensor();
          EXPECT_EQ(t.scalar_type(), at::kFloat) << kind << " of parameter " << entry.key().toInt();
          EXPECT_EQ(t.sizes(), p.sizes()) << kind << " of parameter " << entry.key().toInt();
          if (!detail::coded_numel(p.numel())) continue;
          const bool is_signed = std::string(kind) == "exp_avg";
          auto [codes, scales] = detail::recode(t.contiguous(), is_signed);
          EXPECT_TRUE(detail::dequantise(codes, scales, is_signed).equal(t))
              << kind << " of parameter " << entry.key().toInt() << ": not decoded codes";
        }
      }
      int64_t expected = 0;
      for (const auto& p : params) {
        expected += detail::coded_numel(p.numel()) ? 2 * (p.numel() + 4 * detail::state_blocks(p.numel())) : 8 * p.numel();
      }
      // (Split ranges of a coded tensor start on block boundaries: its blocks are counted once.)
      EXPECT_EQ(sum.item<int64_t>(), expected) << "the state is not codes and scales";
      saved_bytes = torch::pickle_save(oss.state_dict());
    }
    step_all(params, oss, 3, 6);
    if (g->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      straight = params;
    }
  });
  ASSERT_FALSE(saved_bytes.empty());
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    // The parameters the straight run had after 3 steps: the same run's first 3 steps at world 2.
    Params params = make_params();
    {
      OSS first(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
      step_all(params, first, 0, 3);
    }
    OSS resumed(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
    resumed.load_state_dict(torch::pickle_load(testing::broadcast_bytes(g->rank() == 0 ? saved_bytes : std::vector<char>{}, *g)));
    step_all(params, resumed, 3, 6);
    if (g->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      expect_bitwise_equal(straight, params, "resumed at world 2 from world 3");
    }
  });
}

// A rank's shard (sharded checkpoints, Resilient's copies) holds the codes and their scales, not
// fp32 values: its state bytes are the rank's state bytes. Shards saved at world 3 load at world 2
// and the run goes on bit for bit; a shard whose scales are NaN or too few is refused, naming the
// parameter and the entry.
TEST(Int8State, ShardsHoldCodesAndScalesLoadAtAnotherWorldSizeAndCorruptOnesAreRefused) {
  auto step_all = [](Params& params, OSS& oss, int from, int to) {
    for (int step = from; step < to; ++step) {
      for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, step, params[i]);
      oss.step();
    }
  };
  std::vector<c10::IValue> shards(3);
  Params straight;
  std::mutex mu;
  testing::run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
    step_all(params, oss, 0, 3);
    const c10::IValue shard = oss.state_shard();
    int64_t bytes = 0, coded = 0;
    for (const auto& item : shard.toGenericDict().at("shard").toListRef()) {
      const auto d = item.toGenericDict();
      if (!d.contains("state")) continue;
      const auto state = d.at("state").toGenericDict();
      for (const auto& v : state) {
        if (v.value().isTensor() && v.key().toStringRef() != "step") bytes += v.value().toTensor().nbytes();
      }
      if (detail::coded_numel(params[d.at("param").toInt()].numel())) {
        ++coded;
        EXPECT_EQ(state.at("exp_avg").toTensor().scalar_type(), at::kByte);
        EXPECT_EQ(state.at("exp_avg.scales").toTensor().scalar_type(), at::kFloat);
      }
    }
    EXPECT_GT(coded, 0) << "rank " << g->rank();
    EXPECT_EQ(bytes, oss.local_state_bytes()) << "rank " << g->rank() << ": the shard holds more than the codes";
    step_all(params, oss, 3, 6);
    std::lock_guard<std::mutex> lock(mu);
    shards[g->rank()] = shard;
    if (g->rank() == 0) straight = params;
  });
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    {
      OSS first(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
      step_all(params, first, 0, 3);
    }
    OSS resumed(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
    resumed.load_state_dict(resumed.state_dict_from_shards(shards));
    step_all(params, resumed, 3, 6);
    if (g->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      expect_bitwise_equal(straight, params, "world 2 from world 3's shards");
    }
  });
  // Corrupt copies of shard 0: a NaN scale, and scales cut short (a truncated part).
  auto corrupted = [&](const std::function<at::Tensor(const at::Tensor&)>& damage) {
    std::vector<c10::IValue> out = shards;
    auto shard = shards[0].toGenericDict().copy();
    c10::impl::GenericList list(c10::AnyType::get());
    bool done = false;
    for (const auto& item : shard.at("shard").toListRef()) {
      auto d = item.toGenericDict().copy();
      if (!done && d.contains("state") && d.at("state").toGenericDict().contains("exp_avg.scales")) {
        auto state = d.at("state").toGenericDict().copy();
        state.insert_or_assign("exp_avg.scales", damage(state.at("exp_avg.scales").toTensor().clone()));
        d.insert_or_assign("state", state);
        done = true;
      }
      list.push_back(d);
    }
    shard.insert_or_assign("shard", list);
    out[0] = shard;
    return out;
  };
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kSplit));
    auto expect_refused = [&](const std::vector<c10::IValue>& bad, const std::string& needle) {
      try {
        oss.state_dict_from_shards(bad);
        ADD_FAILURE() << "taken: " << needle;
      } catch (const c10::Error& e) {
        const std::string what = e.what_without_backtrace();
        EXPECT_NE(what.find(needle), std::string::npos) << what;
        EXPECT_NE(what.find("8-bit state 'exp_avg'"), std::string::npos) << what;
      }
    };
    expect_refused(corrupted([](at::Tensor s) { return s.fill_(NAN); }), "has a scale of nan at block 0");
    expect_refused(corrupted([](at::Tensor s) { return s.fill_(INFINITY); }), "has a scale of inf at block 0");
    expect_refused(corrupted([](at::Tensor s) { return s.narrow(0, 0, s.numel() - 1).clone(); }), "(truncated or");
  });
}

// SGD's momentum buffer in codes (the signed map) against a reference that codes it with ATen's
// operators after each step.
TEST(Int8State, SgdMomentumFollowsAReferenceThatCodesItsBuffer) {
  constexpr double kMomentum = 0.9;
  Params ref = make_params();
  for (auto& p : ref) p = p.detach().clone();
  std::map<size_t, at::Tensor> buf;  // decoded
  for (int step = 0; step < kSteps; ++step) {
    for (size_t i = 0; i < ref.size(); ++i) {
      const at::Tensor g = (grad_of(i, step, ref[i]) + kWeightDecay * ref[i]).reshape(-1);
      const at::Tensor b = buf.count(i) ? buf[i] * kMomentum + g : g;
      ref[i].sub_((b * kLr).view(ref[i].sizes()));
      buf[i] = detail::coded_numel(b.numel()) ? ReferenceCodes::of(b, true).decoded(true) : b;
    }
  }
  Params got, fp32;
  for (const StateFormat format : {StateFormat::kInt8, StateFormat::kFloat32}) {
    testing::run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
      Params params = make_params();
      OSS oss(params, optimizer<optim::SGD>(optim::SGDOptions(kLr).momentum(kMomentum).weight_decay(kWeightDecay)), g,
              OSSOptions().partition(PartitionMode::kSplit).state_format(format));
      for (int step = 0; step < kSteps; ++step) {
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, step, params[i]);
        oss.step();
      }
      if (g->rank() == 1) (format == StateFormat::kInt8 ? got : fp32) = params;
    });
  }
  const double from_ref = max_difference(got, ref), from_fp32 = max_difference(got, fp32);
  EXPECT_LT(from_ref, 0.1 * from_fp32) << "int8 to the reference " << from_ref << ", int8 to fp32 " << from_fp32;
}

// Each rank its own data through ShardedDDP with bf16 parameters: the masters stay fp32 and are
// the model's values, only the moments are codes (a rank's state bytes under 0.4 of fp32 state's:
// D's codes, and the small tensors' fp32 state), and the run stays near the fp32 state's.
TEST(Int8State, UnderMixedPrecisionAndShardedDDPTheMastersStayFp32) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    std::map<StateFormat, at::Tensor> weights;
    std::map<StateFormat, int64_t> state_bytes;
    for (const StateFormat format : {StateFormat::kFloat32, StateFormat::kInt8}) {
      auto net = std::make_shared<testing::DominantNet>();
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
      if (g->rank() == 0) {
        const auto saved = oss.state_dict().toGenericDict();
        const auto masters = saved.at("master_weights").toGenericDict();
        for (size_t i = 0; i < net->params.size(); ++i) {
          const at::Tensor m = masters.at(static_cast<int64_t>(i)).toTensor();
          EXPECT_EQ(m.scalar_type(), at::kFloat) << "master " << i;
          EXPECT_TRUE(m.to(at::kBFloat16).equal(net->params[i].detach())) << "master " << i;
        }
      }
      weights[format] = net->params[1].detach().to(at::kFloat);
    }
    EXPECT_GT(state_bytes[StateFormat::kInt8], 0);
    EXPECT_LT(state_bytes[StateFormat::kInt8] * 5, state_bytes[StateFormat::kFloat32] * 2) << "rank " << g->rank();
    EXPECT_LE((weights[StateFormat::kInt8] - weights[StateFormat::kFloat32]).abs().max().item<double>(), 0.05);
  });
}

// Muon on the matrices (one coded, one small) and AdamW on the rest: Muon's momentum is coded
// like Adam's first moment (the signed map, blocks of the whole matrix), its own step runs on the
// decoded momentum. The same bits at worlds 1 to 4 through a freeze of an AdamW parameter; the coded
// matrix follows plain shardopt::Muon whose momentum is coded by the reference after each step.
Params train_mixed(int world, StateFormat format) {
  return train_with(world, [&](Params& params, std::shared_ptr<ProcessGroup> g) {
    std::vector<OptimizerGroup> groups;
    groups.push_back({{params[3], params[2]}, optimizer<Muon>(MuonOptions(0.02))});
    groups.push_back({{params[0], params[1], params[4]}, optimizer<optim::AdamW>(optim::AdamWOptions(kLr))});
    return std::make_unique<OSS>(std::move(groups), g, OSSOptions().state_format(format));
  });
}

TEST(Int8State, MuonMomentumIsCodedAndGivesTheSameBitsAtEveryWorldSize) {
  const Params at_one = train_mixed(1, StateFormat::kInt8);
  for (int world : {2, 3, 4}) expect_bitwise_equal(at_one, train_mixed(world, StateFormat::kInt8), "world " + std::to_string(world));
  // The reference: shardopt::Muon alone on the coded matrix, its momentum coded after each step.
  at::Tensor p = make_params()[3].detach().clone().set_requires_grad(true);
  Muon muon({p}, MuonOptions(0.02));
  for (int step = 0; step < kSteps; ++step) {
    p.mutable_grad() = grad_of(3, step, p);
    muon.step();
    auto& st = static_cast<MuonParamState&>(*muon.state().at(compat::state_key(p)));
    const at::Tensor b = st.momentum_buffer().reshape(-1);
    st.momentum_buffer(ReferenceCodes::of(b, true).decoded(true).view(st.momentum_buffer().sizes()));
  }
  const Params fp32 = train_mixed(2, StateFormat::kFloat32);
  const double from_ref = (at_one[3] - p.detach()).abs().max().item<double>();
  const double from_fp32 = (at_one[3] - fp32[3]).abs().max().item<double>();
  EXPECT_LT(from_ref, 0.1 * from_fp32) << "int8 to the reference " << from_ref << ", int8 to fp32 " << from_fp32;
  // The small matrix keeps fp32 momentum: fp32's bits.
  EXPECT_TRUE(at_one[2].equal(fp32[2]));
}

// A user's optimizer, registered with its velocity marked compressible: v <- 0.9 v + g, p <- p - lr v.
struct VelocityOptions : public optim::OptimizerCloneableOptions<VelocityOptions> {
  VelocityOptions(double lr = 0.01) : lr_(lr) {}  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr);
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};
struct VelocityState : public optim::OptimizerCloneableParamState<VelocityState> {
  TORCH_ARG(at::Tensor, velocity);
};
class Velocity : public optim::Optimizer {
 public:
  Velocity(const std::vector<optim::OptimizerParamGroup>& groups, VelocityOptions defaults)
      : Optimizer(groups, std::make_unique<VelocityOptions>(defaults)) {}
  at::Tensor step(LossClosure = nullptr) override {
    at::NoGradGuard no_grad;
    for (auto& group : param_groups_) {
      const double lr = static_cast<const VelocityOptions&>(group.options()).lr();
      for (auto& p : group.params()) {
        if (!p.grad().defined()) continue;
        auto& slot = state_[p.unsafeGetTensorImpl()];
        if (!slot) {
          auto fresh = std::make_unique<VelocityState>();
          fresh->velocity(at::zeros_like(p));
          slot = std::move(fresh);
        }
        auto& v = static_cast<VelocityState&>(*slot).velocity();
        v.mul_(0.9).add_(p.grad());
        p.sub_(v * lr);
      }
    }
    return {};
  }
};
class UncodedVelocity : public Velocity {
  using Velocity::Velocity;
};

template <class Opt>
void register_velocity(const char* name, bool compressible) {
  auto r = OptimizerRegistration<Opt, VelocityOptions, VelocityState>(name, StateKind::kElementWise)
               .option("lr", [](VelocityOptions& o) -> double& { return o.lr(); })
               .tensor("velocity", [](VelocityState& s) -> at::Tensor& { return s.velocity(); });
  if (compressible) r.compressible("velocity", StateCodes::kSigned);
  register_optimizer(r);
}

TEST(Int8State, ARegisteredOptimizerThatMarksItsStateCompressibleIsCodedAtEveryWorldSize) {
  register_velocity<Velocity>("Velocity", true);
  register_velocity<UncodedVelocity>("UncodedVelocity", false);
  auto run = [](int world, StateFormat format) {
    Params out;
    int64_t bytes = 0;
    std::mutex mu;
    testing::run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      Params params = make_params();
      OSS oss(params, optimizer<Velocity>(VelocityOptions(0.01)), g,
              OSSOptions().partition(PartitionMode::kSplit).state_format(format));
      for (int step = 0; step < kSteps; ++step) {
        for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, step, params[i]);
        oss.step();
      }
      at::Tensor total = at::full({1}, oss.local_state_bytes(), at::kLong);
      g->allreduce(total);
      std::lock_guard<std::mutex> lock(mu);
      if (g->rank() == 0) {
        out = params;
        bytes = total.item<int64_t>();
      }
    });
    return std::make_pair(out, bytes);
  };
  const auto [one, one_bytes] = run(1, StateFormat::kInt8);
  const auto [fp32, fp32_bytes] = run(1, StateFormat::kFloat32);
  for (int world : {2, 3}) {
    const auto [got, bytes] = run(world, StateFormat::kInt8);
    expect_bitwise_equal(one, got, "world " + std::to_string(world));
    EXPECT_EQ(bytes, one_bytes) << "world " << world;
  }
  int64_t expected = 0;  // one state tensor: codes and scales of the coded tensors, fp32 of the small ones
  for (const auto& p : one) expected += detail::coded_numel(p.numel()) ? p.numel() + 4 * detail::state_blocks(p.numel()) : 4 * p.numel();
  EXPECT_EQ(one_bytes, expected);
  EXPECT_GT(max_difference(one, fp32), 1e-6) << "the codes changed nothing";
  const auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<UncodedVelocity>(VelocityOptions(0.01)), g, int8_options(PartitionMode::kAuto));
  });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_NE(errors[r].find("UncodedVelocity, whose state this format does not hold"), std::string::npos)
        << "rank " << r << ": " << errors[r];
    EXPECT_NE(errors[r].find("OptimizerRegistration::compressible"), std::string::npos) << errors[r];
  }
}

// ShardedDDP with each rank its own data, the gradient scaler and clipping: a step the scaler skips
// (one rank's gradient overflows) leaves every code and scale as it was, on every rank.
TEST(Int8State, AStepTheScalerSkipsLeavesEveryCodeAsItWasAndClippingWorks) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<testing::DominantNet>();
    OSS oss(net->parameters(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
            OSSOptions().state_format(StateFormat::kInt8));
    ShardedDDP ddp(net, oss);
    ShardedGradScaler scaler(GradScalerOptions().init_scale(1024));
    for (int step = 0; step < 4; ++step) {
      const bool overflow = step == 2;
      const auto data = testing::rank_data(step, g->rank(), 3);
      if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
      unsigned hook = 0;
      if (overflow && g->rank() == 1) {
        hook = net->params[1].register_hook(
            [](const at::Tensor& grad) { return at::full_like(grad, std::numeric_limits<float>::infinity()); });
      }
      const std::vector<char> before = torch::pickle_save(oss.state_shard());
      const Params params_before = testing::clone_params(net->params);
      ddp.zero_grad();
      scaler.scale(testing::loss_of(ddp.forward(data.x), data, 3)).backward();
      if (overflow && g->rank() == 1) net->params[1].remove_hook(hook);
      scaler.unscale_(oss);
      const double norm = oss.clip_grad_norm(0.5);
      const bool stepped = scaler.step(oss);
      scaler.update();
      EXPECT_EQ(stepped, !overflow) << "step " << step << " on rank " << g->rank();
      if (!overflow) EXPECT_TRUE(std::isfinite(norm)) << "step " << step;
      const bool same = torch::pickle_save(oss.state_shard()) == before;
      EXPECT_EQ(same, overflow) << "step " << step << " on rank " << g->rank() << ": the codes "
                                << (overflow ? "changed in a skipped step" : "did not change in a step");
      if (overflow) {
        for (size_t i = 0; i < net->params.size(); ++i) EXPECT_TRUE(net->params[i].equal(params_before[i])) << i;
      }
    }
  });
}

TEST(Int8State, WhatInt8StateCannotHoldIsRefusedOnEveryRankNamingIt) {
  auto refused = [](const std::function<void(std::shared_ptr<ProcessGroup>)>& make, const std::string& needle) {
    const auto errors = testing::run_ranks_collect_errors(2, make);
    for (size_t r = 0; r < errors.size(); ++r) {
      EXPECT_NE(errors[r].find(needle), std::string::npos) << "rank " << r << ": " << errors[r];
    }
  };
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::RMSprop>(optim::RMSpropOptions(kLr)), g, int8_options(PartitionMode::kAuto));
  }, "OSSOptions::state_format(int8): param group 0's optimizer is torch::optim::RMSprop");
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
            int8_options(PartitionMode::kAuto).fused_step(false));
  }, "OSSOptions::state_format(int8) needs the fused step");
  refused([](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g,
            OSSOptions().state_format(g->rank() == 0 ? StateFormat::kBFloat16 : StateFormat::kInt8));
  }, "state_format");
  // A consolidated state whose moment has the wrong size: every rank names the entry and parameter.
  c10::IValue saved;
  testing::run_ranks(1, [&](std::shared_ptr<ProcessGroup> g) {
    Params params = make_params();
    OSS oss(params, optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kAuto));
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grad_of(i, 0, params[i]);
    oss.step();
    oss.consolidate_state_dict(0);
    saved = oss.state_dict();
    auto state = saved.toGenericDict().at("state").toGenericDict().at(1).toGenericDict();
    state.insert_or_assign("exp_avg", state.at("exp_avg").toTensor().narrow(0, 0, 4000).clone());
  });
  refused([&](std::shared_ptr<ProcessGroup> g) {
    OSS oss(make_params(), optimizer<optim::AdamW>(optim::AdamWOptions(kLr)), g, int8_options(PartitionMode::kAuto));
    oss.load_state_dict(saved);
  }, "state 'exp_avg' of parameter 1 has shape [4000]");
  EXPECT_EQ(parse_state_format("int8"), StateFormat::kInt8);
  try {
    parse_state_format("int4");
    ADD_FAILURE() << "int4 was taken";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("unknown state format 'int4': use fp32, bf16 or int8"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
