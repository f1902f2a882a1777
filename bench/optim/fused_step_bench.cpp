// The fused AdamW step on one 12M-parameter fp32 shard (and OSS's whole step over GPT-2 small's
// 148 tensors against ATen's multi-tensor kernel over the same list), against torch::optim::AdamW's step,
// ATen's fused kernel (at::_fused_adamw_) on the same flat tensors, the whole step as OSS runs it
// (world size 1: the fused step plus OSS's bookkeeping), and the memory floor: a streaming loop
// with the step's read/write mix (4 arrays read, 3 written), whose time is the least any AdamW
// step over these bytes can take on this machine. Argument: intra-op threads.
//
//   build/bench/fused_step_bench --benchmark_counters_tabular=true --benchmark_repetitions=5 \
//       --benchmark_report_aggregates_only=true
#include "models/gpt2.h"
#include <shardopt/optim/fused_step.h>
#include <shardopt/optim/oss.h>
#include <shardopt/testing/introspection.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <algorithm>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

using shardopt::testing::Introspection;

namespace {

namespace optim = torch::optim;
constexpr int64_t kN = 12 << 20;  // 12,582,912 elements
constexpr double kStepBytes = 7.0 * 4 * kN;  // p, g, m, v read; p, m, v written

optim::AdamWOptions options() { return optim::AdamWOptions(1e-3).weight_decay(0.01); }

at::Tensor param() {
  at::Tensor p = at::randn({kN}) * 0.02;
  p.requires_grad_();
  p.mutable_grad() = at::randn({kN}) * 1e-3;
  return p;
}

void report(benchmark::State& state) {
  state.counters["GB/s"] = benchmark::Counter(kStepBytes * static_cast<double>(state.iterations()) / 1e9,
                                              benchmark::Counter::kIsRate);
}

void BM_TorchOptimAdamW(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = param();
  optim::AdamW opt({p}, options());
  for (auto _ : state) opt.step();
  report(state);
}

void BM_AtenFusedAdamW(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = param().detach(), g = at::randn({kN}) * 1e-3, m = at::zeros({kN}), v = at::zeros({kN});
  at::Tensor step = at::zeros({}, at::kFloat);
  for (auto _ : state) {
    step.add_(1);
    at::_fused_adamw_({p}, {g}, {m}, {v}, {}, {step}, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false, std::nullopt,
                      std::nullopt);
  }
  report(state);
}

void BM_ShardoptFusedStep(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = param();
  optim::AdamW opt({p}, options());
  for (auto _ : state) shardopt::fused_step(opt);
  report(state);
}

// OSS(AdamW) over one rank holding the shard, with a gradient.
struct OssWorldOne {
  explicit OssWorldOne(int threads) {
    at::set_num_threads(threads);
    p.mutable_grad() = g;
  }
  std::shared_ptr<shardopt::ProcessGroup> group = shardopt::init_process_group(
      c10::make_intrusive<c10d::HashStore>(), shardopt::InitOptions().backend("gloo").rank(0).world_size(1));
  at::Tensor p = param();
  at::Tensor g = p.grad().clone();
  shardopt::OSS opt{{p}, shardopt::optimizer<optim::AdamW>(options()), group};
};

void BM_OssStepWorldOne(benchmark::State& state) {
  OssWorldOne w(static_cast<int>(state.range(0)));
  shardopt::OSS& opt = w.opt;
  for (auto _ : state) opt.step();
  state.counters["fused"] = shardopt::testing::Introspection::stepped_fused(opt) ? 1 : 0;
  report(state);
}

// Side by side in one loop: ATen's fused kernel (its multi-tensor path, over the same tensor
// list) and OSS::step (world size 1, per-parameter step counts and all) take turns on the very
// same parameters, gradients and state tensors (OSS's own, views into its slabs), `pairs` pairs
// per iteration. Separate benchmarks run minutes apart on this shared machine and land on memory
// placed differently; pairs see the same conditions. Counters: each one's median (ms) and the
// median of the per-pair ratios ATen / OSS (above 1: OSS is faster).
// With `per_tensor`, a third contender takes its turn in each pair: shardopt::fused_step over one
// torch::optim::AdamW per tensor, on the same parameters and gradients (state of its own): one
// pass, and one parallel region, per tensor, as OSS stepped before its state moved into slabs.
void paired_aten_vs_oss(benchmark::State& state, shardopt::OSS& opt, const std::vector<at::Tensor>& params,
                        int pairs, bool per_tensor = false) {
  opt.step();  // creates the state
  std::vector<at::Tensor> p, g, m, v, steps;
  // At world 1, the tensors OSS steps over `params`, in their order (one group).
  const auto& stepped = Introspection::local_optimizer(opt).param_groups().at(0).params();
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& param = params[i];
    auto& st = static_cast<optim::AdamWParamState&>(*Introspection::local_optimizer(opt).state().at(stepped.at(i).unsafeGetTensorImpl()));
    p.push_back(param.detach());
    g.push_back(param.grad());
    m.push_back(st.exp_avg());
    v.push_back(st.exp_avg_sq());
    steps.push_back(at::zeros({}, at::kFloat));
  }
  std::vector<std::unique_ptr<optim::AdamW>> singles;
  for (size_t i = 0; per_tensor && i < p.size(); ++i) {
    at::Tensor view = p[i].detach();
    view.mutable_grad() = g[i];
    singles.push_back(std::make_unique<optim::AdamW>(std::vector<at::Tensor>{view}, options()));
  }
  std::vector<double> aten, oss, ratio, single, single_ratio;
  using Clock = std::chrono::steady_clock;
  const auto ms = [](Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); };
  for (auto _ : state) {
    for (int pair = 0; pair < pairs; ++pair) {
      const auto t0 = Clock::now();
      at::_foreach_add_(steps, 1);
      at::_fused_adamw_(p, g, m, v, {}, steps, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false, std::nullopt, std::nullopt);
      const auto t1 = Clock::now();
      opt.step();
      const auto t2 = Clock::now();
      aten.push_back(ms(t1 - t0));
      oss.push_back(ms(t2 - t1));
      ratio.push_back(aten.back() / oss.back());
      if (!per_tensor) continue;
      for (auto& one : singles) shardopt::fused_step(*one);
      single.push_back(ms(Clock::now() - t2));
      single_ratio.push_back(single.back() / oss.back());
    }
  }
  const auto median = [](std::vector<double> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
  };
  state.counters["aten_ms"] = median(aten);
  state.counters["oss_ms"] = median(oss);
  state.counters["aten/oss"] = median(ratio);
  if (per_tensor) {
    state.counters["per_tensor_ms"] = median(single);
    state.counters["per_tensor/oss"] = median(single_ratio);
  }
  state.counters["fused"] = shardopt::testing::Introspection::stepped_fused(opt) ? 1 : 0;
}

void BM_PairedAtenVsOssStep(benchmark::State& state) {
  OssWorldOne w(static_cast<int>(state.range(0)));
  paired_aten_vs_oss(state, w.opt, {w.p}, 40);
}

// GPT-2 small's 148 parameters (124M elements) under OSS at world size 1: the shard OSS owns is
// all of them; 98 of the tensors are biases and norms of 768 to 3,072 elements.
void BM_PairedAtenVsOssStepGpt2(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto group = shardopt::init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                            shardopt::InitOptions().backend("gloo").rank(0).world_size(1));
  std::vector<at::Tensor> params;
  for (const auto& [name, shape] : shardopt::models::gpt2_shapes()) {
    at::Tensor p = (at::randn(shape) * 0.02).requires_grad_();
    p.mutable_grad() = at::randn(shape) * 1e-3;
    params.push_back(p);
  }
  shardopt::OSS opt(params, shardopt::optimizer<optim::AdamW>(options()), group);
  paired_aten_vs_oss(state, opt, params, 10, /*per_tensor=*/true);
}

// The host's share: as many tensors as GPT-2 small has (148) but of 64 elements each, so the time
// is the per-tensor bookkeeping of a step, the part a GPU waits on (docs/benchmarks-log.md, "Many
// parameters in few launches").
void BM_PairedAtenVsOssStepHost(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  auto group = shardopt::init_process_group(c10::make_intrusive<c10d::HashStore>(),
                                            shardopt::InitOptions().backend("gloo").rank(0).world_size(1));
  std::vector<at::Tensor> params;
  for (size_t i = 0; i < shardopt::models::gpt2_shapes().size(); ++i) {
    at::Tensor p = (at::randn({64}) * 0.02).requires_grad_();
    p.mutable_grad() = at::randn({64}) * 1e-3;
    params.push_back(p);
  }
  shardopt::OSS opt(params, shardopt::optimizer<optim::AdamW>(options()), group);
  paired_aten_vs_oss(state, opt, params, 200);
}

// The floor: each element read from 4 arrays and written to 3, with a few flops, as AdamW does.
void BM_StreamingFloor(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = at::randn({kN}), g = at::randn({kN}), m = at::randn({kN}), v = at::randn({kN});
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  using Vec = at::vec::Vectorized<float>;
  auto range = [&](int64_t begin, int64_t end) {
    const Vec a(0.5f), b(0.25f);
    for (int64_t i = begin; i < end; i += Vec::size()) {
      const int64_t k = std::min<int64_t>(Vec::size(), end - i);
      const Vec gv = Vec::loadu(gp + i, k);
      (Vec::loadu(mp + i, k) * a + gv).store(mp + i, k);
      (Vec::loadu(vp + i, k) * b + gv).store(vp + i, k);
      (Vec::loadu(pp + i, k) * a + gv).store(pp + i, k);
    }
  };
  const int64_t threads = state.range(0), chunk = (kN / threads + 63) / 64 * 64;
  for (auto _ : state) {
    std::vector<std::thread> others;
    for (int64_t t = 1; t < threads; ++t) others.emplace_back(range, t * chunk, std::min(kN, (t + 1) * chunk));
    range(0, std::min(kN, chunk));
    for (auto& t : others) t.join();
    benchmark::ClobberMemory();
  }
  report(state);
}

void threads(benchmark::internal::Benchmark* b) {
  b->Arg(1);
  if (at::get_num_threads() > 1) b->Arg(at::get_num_threads());
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_StreamingFloor)->Apply(threads);
BENCHMARK(BM_TorchOptimAdamW)->Apply(threads);
BENCHMARK(BM_AtenFusedAdamW)->Apply(threads);
BENCHMARK(BM_ShardoptFusedStep)->Apply(threads);
BENCHMARK(BM_OssStepWorldOne)->Apply(threads);
BENCHMARK(BM_PairedAtenVsOssStep)->Apply(threads)->Iterations(3);
BENCHMARK(BM_PairedAtenVsOssStepGpt2)->Apply(threads)->Iterations(3);
BENCHMARK(BM_PairedAtenVsOssStepHost)->Arg(1)->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
