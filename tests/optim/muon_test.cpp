// shardopt::Muon against PyTorch 2.11's torch.optim.Muon (the same wheel's Python side): every
// option, bit for bit on one thread, a parameter without a gradient left alone, PyTorch's errors,
// and a saved optimizer that resumes with the same steps.
#include <shardopt/optim/muon.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using Params = std::vector<at::Tensor>;

std::vector<char> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// One thread, as the reference ran: the bf16 matrix products then sum in the same order.
struct OneThread {
  OneThread() : threads(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(threads); }
  int threads;
};

// The options of a case of tests/python/muon_reference.py, PyTorch's defaults where it gives none.
MuonOptions options_of(const c10::impl::GenericDict& saved) {
  MuonOptions o(saved.at("lr").toDouble());
  auto has = [&](const char* key) { return saved.contains(key) && !saved.at(key).isNone(); };
  if (has("weight_decay")) o.weight_decay(saved.at("weight_decay").toDouble());
  if (has("momentum")) o.momentum(saved.at("momentum").toDouble());
  if (has("nesterov")) o.nesterov(saved.at("nesterov").toBool());
  if (has("ns_coefficients")) {
    std::vector<double> c;
    for (const auto& v : saved.at("ns_coefficients").toTupleRef().elements()) c.push_back(v.toDouble());
    o.ns_coefficients(c);
  }
  if (has("ns_steps")) o.ns_steps(saved.at("ns_steps").toInt());
  if (has("eps")) o.eps(saved.at("eps").toDouble());
  if (has("adjust_lr_fn")) o.adjust_lr_fn(saved.at("adjust_lr_fn").toStringRef());
  return o;
}

TEST(Muon, EveryOptionStepsBitForBitAsTorchOptimMuon) {
  const std::string path = ::testing::TempDir() + "/muon_reference.pt";
  const std::string cmd = std::string(SHARDOPT_PYTHON_EXE) + " " + SHARDOPT_SOURCE_DIR +
                          "/tests/python/muon_reference.py " + path;
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const auto cases = torch::pickle_load(read_file(path)).toList();
  ASSERT_EQ(cases.size(), 5u);
  OneThread one;
  for (const auto& item : cases) {
    const auto c = item.get().toGenericDict();
    const std::string name = c.at("name").toStringRef();
    Params params;
    for (const auto& p : c.at("params").toList()) params.push_back(p.get().toTensor().clone().requires_grad_(true));
    const Params before = [&] {
      Params copy;
      for (const auto& p : params) copy.push_back(p.detach().clone());
      return copy;
    }();
    Muon opt(params, options_of(c.at("options").toGenericDict()));
    const auto grads = c.at("grads").toList(), after = c.at("after").toList();
    for (size_t step = 0; step < grads.size(); ++step) {
      const auto g = grads.get(step).toList();
      for (size_t i = 0; i < params.size(); ++i) {
        params[i].mutable_grad() = g.get(i).isNone() ? at::Tensor() : g.get(i).toTensor().clone();
      }
      opt.step();
      const auto want = after.get(step).toList();
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::equal(params[i].detach(), want.get(i).toTensor()))
            << name << ", step " << step << ", parameter " << i << ": largest difference "
            << (params[i].detach() - want.get(i).toTensor()).abs().max().item<float>();
      }
    }
    // The parameter that never had a gradient: not decayed, no state.
    EXPECT_TRUE(at::equal(params[3].detach(), before[3])) << name;
    EXPECT_EQ(opt.state().count(params[3].unsafeGetTensorImpl()), 0u) << name;
    EXPECT_EQ(opt.state().size(), 3u) << name;
  }
}

// The message of the error `fn` raises ("" when none).
template <class F>
std::string error_of(F&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Muon, RefusesWhatTorchOptimMuonRefusesWithItsMessages) {
  const Params matrix = {at::randn({3, 4}).requires_grad_(true)};
  EXPECT_NE(error_of([] { Muon({at::randn({3}).requires_grad_(true)}); })
                .find("Muon only supports 2D parameters whereas we found a parameter with size: torch.Size([3])"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Muon(matrix, MuonOptions(-0.5)); }).find("Learning rate should be >= 0 but is: -0.5"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Muon(matrix, MuonOptions().momentum(-1)); }).find("momentum should be >= 0 but is: -1"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Muon(matrix, MuonOptions().weight_decay(-0.25)); })
                .find("weight decay should be >= 0 but is: -0.25"),
            std::string::npos);
  EXPECT_NE(error_of([&] { Muon(matrix, MuonOptions().adjust_lr_fn("spectral")); })
                .find("Adjust learning rate function spectral is not supported"),
            std::string::npos);

  auto step_error = [](MuonOptions options, at::Tensor param, at::Tensor grad) {
    Muon opt({param}, options);
    param.mutable_grad() = grad;
    return error_of([&] { opt.step(); });
  };
  EXPECT_NE(step_error(MuonOptions(), at::randn({3, 4}), at::randn({3, 4}).to_sparse())
                .find("Muon does not support sparse gradients"),
            std::string::npos);
  EXPECT_NE(step_error(MuonOptions(), at::randn({3, 4}, at::kComplexFloat), at::randn({3, 4}, at::kComplexFloat))
                .find("Muon does not support complex parameters"),
            std::string::npos);
  EXPECT_NE(step_error(MuonOptions().ns_steps(100), at::randn({3, 4}), at::randn({3, 4}))
                .find("Number of steps must be less than 100 for computational efficiency"),
            std::string::npos);
  EXPECT_NE(step_error(MuonOptions().ns_coefficients({3.4445, -4.775}), at::randn({3, 4}), at::randn({3, 4}))
                .find("Coefficients must be a tuple of exactly 3 values"),
            std::string::npos);
  EXPECT_EQ(step_error(MuonOptions().ns_steps(99), at::randn({3, 4}), at::randn({3, 4})), "");
}

// torch::save / torch::load of the optimizer: the loaded one takes the same next step, options
// included (the loaded group's options replace the new optimizer's).
TEST(Muon, ASavedOptimizerResumesWithTheSameSteps) {
  auto make = [] {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
    return Params{at::randn({6, 4}, gen).requires_grad_(true), at::randn({4, 6}, gen).requires_grad_(true)};
  };
  auto grad = [](const at::Tensor& p, int step) { return at::sin(at::arange(p.numel(), at::kFloat) + step).view_as(p); };
  const MuonOptions options = MuonOptions(0.04).momentum(0.8).nesterov(false).adjust_lr_fn("match_rms_adamw");
  Params a = make(), b = make();
  Muon first(a, options);
  for (int step = 0; step < 2; ++step) {
    for (auto& p : a) p.mutable_grad() = grad(p, step);
    first.step();
  }
  std::ostringstream saved;
  torch::save(first, saved);
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  Muon second(b, MuonOptions(1.0));
  std::istringstream in(saved.str());
  torch::load(second, in);
  EXPECT_TRUE(static_cast<const MuonOptions&>(second.param_groups()[0].options()) == options);
  for (auto* opt : {&first, &second}) {
    for (auto& p : opt == &first ? a : b) p.mutable_grad() = grad(p, 2);
    opt->step();
  }
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i])) << "parameter " << i;
}

// flatten (shardopt's own option): a conv filter bank [out, in, k, k] steps as the matrix
// [out, in * k * k] does under plain Muon, bit for bit, with its state in the filter's shape;
// without the option it is refused, the message naming the option.
TEST(Muon, FlattenStepsAFilterBankAsItsMatrix) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  const at::Tensor start = at::randn({6, 2, 3, 3}, gen);
  at::Tensor filters = start.clone().requires_grad_(true), matrix = start.reshape({6, 18}).clone().requires_grad_(true);
  const auto options = MuonOptions(0.02).adjust_lr_fn("match_rms_adamw");
  Muon flat({filters}, MuonOptions(options).flatten(true));
  Muon plain({matrix}, options);
  for (int step = 0; step < 4; ++step) {
    const at::Tensor g = at::sin(at::arange(108).to(at::kFloat) * 0.3 + step);
    filters.mutable_grad() = g.reshape({6, 2, 3, 3});
    matrix.mutable_grad() = g.reshape({6, 18});
    flat.step();
    plain.step();
    ASSERT_TRUE(at::equal(filters.detach().reshape({6, 18}), matrix.detach())) << "step " << step;
  }
  const auto& state = static_cast<const MuonParamState&>(*flat.state().at(filters.unsafeGetTensorImpl()));
  EXPECT_EQ(state.momentum_buffer().sizes(), filters.sizes());
  const std::string refused = error_of([&] { Muon bad({start.clone().requires_grad_(true)}, options); });
  EXPECT_NE(refused.find("torch.Size([6, 2, 3, 3])"), std::string::npos) << refused;
  EXPECT_NE(refused.find("flatten(true)"), std::string::npos) << refused;
  EXPECT_DOUBLE_EQ(muon_cost({6, 2, 3, 3}), muon_cost({6, 18}));
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
