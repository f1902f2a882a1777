// OSS state and Python's torch.optim, both ways, for every optimizer shardopt encodes: a
// consolidated C++ state loads into the same torch.optim class and one more step matches; a state
// saved by torch.optim loads into OSS at world sizes 2 and 3 and one more step matches Python's.
// Python is the interpreter of the project's own environment (the same torch wheel).
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <fstream>
#include <mutex>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// The same options as OPTIONS in tests/python/optim_interop.py.
struct Case {
  const char* name;
  OptimizerFactory factory;
};
std::vector<Case> cases() {
  return {
      {"Adam", optimizer<optim::Adam>(optim::AdamOptions(0.02).betas({0.8, 0.95}).weight_decay(0.01).amsgrad(true))},
      {"AdamW", optimizer<optim::AdamW>(optim::AdamWOptions(0.02).betas({0.85, 0.99}).weight_decay(0.1))},
      {"SGD", optimizer<optim::SGD>(optim::SGDOptions(0.05).momentum(0.9).nesterov(true).weight_decay(0.01))},
      {"RMSprop", optimizer<optim::RMSprop>(optim::RMSpropOptions(0.01).alpha(0.9).momentum(0.5).centered(true))},
      {"Adagrad", optimizer<optim::Adagrad>(optim::AdagradOptions(0.05).lr_decay(0.01).weight_decay(0.01))},
  };
}

std::string python(const std::string& args) {
  return std::string(SHARDOPT_PYTHON_EXE) + " " + SHARDOPT_SOURCE_DIR + "/tests/python/optim_interop.py " + args;
}

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The input of optim_interop.py's `step`: the optimizer's name, the parameters and gradients
// (fp32 copies), and the consolidated state.
void write_step_input(const std::string& path, const std::string& name, const Params& p, const c10::IValue& state) {
  auto blob = c10::impl::GenericDict(c10::StringType::get(), c10::AnyType::get());
  c10::impl::GenericList params(c10::AnyType::get()), grads(c10::AnyType::get());
  for (auto& t : p) params.push_back(t.detach().to(at::kFloat, false, true)), grads.push_back(t.grad().to(at::kFloat, false, true));
  blob.insert("optimizer", name);
  blob.insert("params", params);
  blob.insert("grads", grads);
  blob.insert("state", state);
  auto bytes = torch::pickle_save(blob);
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// One step Python takes from an input file: where it writes the parameters, what they must be
// (within `tolerance`, relative), and what to call them in a failure.
struct PythonStep {
  std::string in_path, out_path;
  Params want;
  std::string what;
};

// Runs optim_interop.py `command` IN OUT ... over `steps` (one interpreter) and checks that the
// parameters Python wrote to each OUT are its `want`.
void expect_python_steps(const std::string& command, const std::vector<PythonStep>& steps, double tolerance) {
  std::string args = command;
  for (const auto& s : steps) args += " " + s.in_path + " " + s.out_path;
  const std::string cmd = python(args);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& s : steps) {
    auto after_py = torch::pickle_load(read_file(s.out_path)).toList();
    ASSERT_EQ(after_py.size(), s.want.size()) << s.what;
    for (size_t i = 0; i < s.want.size(); ++i) {
      EXPECT_LE(testing::rel_diff(s.want[i], after_py.get(i).toTensor()), tolerance) << s.what << " " << i;
    }
  }
}

void expect_python_step(const std::string& command, const std::string& in_path, const std::string& out_path,
                        const Params& want, double tolerance, const std::string& what) {
  expect_python_steps(command, {{in_path, out_path, want, what}}, tolerance);
}

// Gradients summed over ranks of a global batch of 12: the same on every world size.
void backward_global(const Params& params, int64_t step, ProcessGroup& g) {
  const int per_rank = 12 / g.size();
  testing::loss(params, testing::rank_data(step, g.rank(), per_rank), 12).backward();
  testing::allreduce_grads(params, g, /*average=*/false);
}

// Three steps, the state consolidated on rank 0, then the gradients of a fourth step: what
// optim_interop.py's `step` continues from.
void three_steps_then_consolidate(OSS& oss, const Params& p, ProcessGroup& g) {
  for (int s = 0; s < 3; ++s) {
    oss.zero_grad(true);
    backward_global(p, s, g);
    oss.step();
  }
  oss.consolidate_state_dict(0);
  oss.zero_grad(true);
  backward_global(p, 3, g);
}

TEST(PythonInterop, ConsolidatedStateLoadsIntoTorchOptimAndTakesTheSameStep) {
  std::vector<PythonStep> steps;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::string dir = ::testing::TempDir();
    const std::string in_path = dir + "/oss_" + c.name + "_state.pt", out_path = dir + "/oss_" + c.name + "_after.pt";
    std::mutex mu;
    Params after_cpp;
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      Params p = testing::make_params();
      OSS oss(p, c.factory, g, OSSOptions().partition(PartitionMode::kSplit));
      ASSERT_EQ(oss.owners(p[0]).size(), 2u) << "w1 is split across both ranks: the state dict stitches it";
      three_steps_then_consolidate(oss, p, *g);
      if (g->rank() == 0) {
        write_step_input(in_path, c.name, p, oss.state_dict());
      }
      oss.step();
      if (g->rank() == 0) {
        std::lock_guard<std::mutex> lock(mu);
        after_cpp = testing::clone_params(p);
      }
    });
    steps.push_back({in_path, out_path, after_cpp, std::string(c.name) + " parameter"});
  }
  expect_python_steps("step", steps, 1e-6);
}

// Mixed precision: the consolidated state (with "master_weights") loads into torch.optim.Adam
// over the fp32 masters, and its next step equals OSS's next step of the masters.
TEST(PythonInterop, MixedPrecisionStateResumesInTorchOptimFromTheMasters) {
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/oss_mixed_state.pt", out_path = dir + "/oss_mixed_after.pt";
  const auto all = cases();
  const auto& c = all[0];  // Adam, amsgrad and weight decay on
  std::mutex mu;
  Params masters_after;
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, c.factory, g,
            OSSOptions().partition(PartitionMode::kSplit).mixed_precision(MixedPrecision().param_dtype(at::kBFloat16)));
    auto backward = [&](int64_t step) {
      const auto data = testing::rank_data(step, g->rank(), 6);
      testing::loss_of(testing::output(p, data.x.to(at::kBFloat16)), data, 12).backward();
      testing::allreduce_grads(p, *g, /*average=*/false);
    };
    for (int s = 0; s < 3; ++s) {
      oss.zero_grad(true);
      backward(s);
      oss.step();
    }
    oss.consolidate_state_dict(0);
    oss.zero_grad(true);
    backward(3);
    if (g->rank() == 0) {
      write_step_input(in_path, c.name, p, oss.state_dict());
    }
    oss.step();
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      const auto m = oss.state_dict().toGenericDict().at("master_weights").toGenericDict();
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 0; i < p.size(); ++i) masters_after.push_back(m.at(static_cast<int64_t>(i)).toTensor());
    }
  });
  expect_python_step("step", in_path, out_path, masters_after, 1e-6, "master");
}

TEST(PythonInterop, TorchOptimStateLoadsIntoOssAtWorldSizesTwoAndThree) {
  const auto path_of = [](const Case& c) { return ::testing::TempDir() + "/torch_" + c.name + "_state.pt"; };
  std::string make = "make";
  for (const auto& c : cases()) make += std::string(" ") + c.name + " " + path_of(c);
  const std::string cmd = python(make);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  for (const auto& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::string path = path_of(c);
    const auto blob = torch::pickle_load(read_file(path)).toGenericDict();
    const auto saved_params = blob.at("params").toList(), grads = blob.at("grads").toList(),
               after = blob.at("after").toList();
    const double saved_lr = blob.at("state").toGenericDict().at("param_groups").toListRef()[0]
                                .toGenericDict().at("lr").toDouble();
    for (int world : {2, 3}) {
      run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
        Params p;
        for (size_t i = 0; i < saved_params.size(); ++i) {
          p.push_back(saved_params.get(i).toTensor().clone().requires_grad_());
        }
        OSS oss(p, c.factory, g);
        oss.load_state_dict(blob.at("state"));
        EXPECT_DOUBLE_EQ(oss.param_groups()[0].options().get_lr(), saved_lr);
        for (size_t i = 0; i < p.size(); ++i) p[i].mutable_grad() = grads.get(i).toTensor().clone();
        oss.step();
        for (size_t i = 0; i < p.size(); ++i) {
          EXPECT_LE(testing::rel_diff(p[i], after.get(i).toTensor()), 1e-6) << c.name << " parameter " << i << " at world " << world;
        }
      });
    }
  }
}

// ---- Muon and AdamW in one OSS ----------------------------------------------------------------

// The same options as MUON_OPTIONS and ADAMW_OPTIONS in tests/python/optim_interop.py: Muon on the
// two matrices (parameters 0 and 2 of the test model), AdamW on the three vectors; the OSS numbers
// the matrices first.
OSS muon_and_adamw(const Params& p, std::shared_ptr<ProcessGroup> g) {
  return OSS({{{p[0], p[2]}, optimizer<Muon>(MuonOptions(0.02).weight_decay(0.01).momentum(0.9).adjust_lr_fn("match_rms_adamw"))},
              {{p[1], p[3], p[4]}, optimizer<optim::AdamW>(optim::AdamWOptions(3e-3).betas({0.85, 0.99}).weight_decay(0.01))}},
             std::move(g));
}

// One thread, as Python runs: Muon's bfloat16 products then sum in the same order.
struct OneThread {
  OneThread() : threads(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(threads); }
  int threads;
};

// Muon's update is bfloat16: steps that see the same bits give the same bits, so the bound is
// float rounding, as for the other optimizers.
constexpr double kMuonTolerance = 1e-6;

TEST(PythonInterop, MuonAndAdamWStateLoadsIntoTorchOptimMuonAndAdamWAndTakesTheSameStep) {
  OneThread one;
  const std::string dir = ::testing::TempDir();
  const std::string in_path = dir + "/oss_muon_state.pt", out_path = dir + "/oss_muon_after.pt";
  std::mutex mu;
  Params after_cpp;
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss = muon_and_adamw(p, g);
    three_steps_then_consolidate(oss, p, *g);
    const Params in_order{p[0], p[2], p[1], p[3], p[4]};
    if (g->rank() == 0) write_step_input(in_path, "Muon+AdamW", in_order, oss.state_dict());
    oss.step();
    if (g->rank() == 0) {
      std::lock_guard<std::mutex> lock(mu);
      after_cpp = testing::clone_params(in_order);
    }
  });
  expect_python_step("muon-step", in_path, out_path, after_cpp, kMuonTolerance, "parameter");
}

TEST(PythonInterop, TorchOptimMuonAndAdamWStateLoadsIntoOssAtWorldSizesTwoAndThree) {
  OneThread one;
  const std::string path = ::testing::TempDir() + "/torch_muon_state.pt";
  const std::string cmd = python("muon-make " + path);
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto blob = torch::pickle_load(read_file(path)).toGenericDict();
  const auto saved_params = blob.at("params").toList(), grads = blob.at("grads").toList(),
             after = blob.at("after").toList();
  for (int world : {2, 3}) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      // Python's order: the matrices, then the vectors; the test model's order for muon_and_adamw.
      Params p(5);
      const size_t model_index[] = {0, 2, 1, 3, 4};
      for (size_t k = 0; k < 5; ++k) p[model_index[k]] = saved_params.get(k).toTensor().clone().requires_grad_();
      OSS oss = muon_and_adamw(p, g);
      oss.load_state_dict(blob.at("state"));
      EXPECT_DOUBLE_EQ(oss.param_groups()[0].options().get_lr(), 0.02);
      EXPECT_EQ(static_cast<const MuonOptions&>(oss.param_groups()[0].options()).adjust_lr_fn(), "match_rms_adamw");
      for (size_t k = 0; k < 5; ++k) p[model_index[k]].mutable_grad() = grads.get(k).toTensor().clone();
      oss.step();
      for (size_t k = 0; k < 5; ++k) {
        EXPECT_LE(testing::rel_diff(p[model_index[k]], after.get(k).toTensor()), kMuonTolerance)
            << "parameter " << k << " (Python's order) at world " << world;
      }
    });
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
