// Per-rank optimizer-state bytes and step() time of OSS(Adam) against the unsharded
// torch::optim::Adam, on a ~25M-parameter model in GPT-2-like shapes. Ranks are threads of this
// process over Gloo (loopback), one intra-op thread each.
//
//   build/oss_bench --benchmark_counters_tabular=true
#include "median.h"

#include "models/gpt2.h"
#include <shardopt/optim/oss.h>

#include "harness.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <algorithm>
#include <chrono>
#include <mutex>
#include <shardopt/testing/introspection.h>

using shardopt::testing::Introspection;

namespace {

namespace optim = torch::optim;

// GPT-2's shape at vocab 10000, context 512, width 512, 6 blocks (~24.4M parameters).
std::vector<at::Tensor> gpt2_like_params() {
  std::vector<at::Tensor> params;
  for (const auto& layer : shardopt::models::gpt2_shapes(512, 10000, 512, 6)) {
    at::Tensor p = at::randn(layer.shape) * 0.02;
    p.requires_grad_();
    p.mutable_grad() = at::randn(layer.shape) * 1e-3;
    params.push_back(p);
  }
  return params;
}

int64_t numel(const std::vector<at::Tensor>& ps) {
  int64_t n = 0;
  for (auto& p : ps) n += p.numel();
  return n;
}

constexpr int kWarmup = 2, kSteps = 10;

using shardopt::bench::median;

void BM_AdamUnsharded(benchmark::State& state) {
  at::set_num_threads(1);
  auto params = gpt2_like_params();
  optim::Adam opt(params, optim::AdamOptions(1e-3));
  for (int i = 0; i < kWarmup; ++i) opt.step();
  for (auto _ : state) {
    auto t0 = std::chrono::steady_clock::now();
    opt.step();
    state.SetIterationTime(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  int64_t bytes = 0;
  for (auto& [k, s] : opt.state()) {
    auto& a = static_cast<optim::AdamParamState&>(*s);
    bytes += a.exp_avg().nbytes() + a.exp_avg_sq().nbytes();
  }
  state.counters["params"] = static_cast<double>(numel(params));
  state.counters["state_bytes_per_rank"] = static_cast<double>(bytes);
  state.counters["fraction_of_unsharded"] = 1.0;
}
BENCHMARK(BM_AdamUnsharded)->UseManualTime()->Iterations(kSteps)->Unit(benchmark::kMillisecond);

// One benchmark iteration = kSteps steps on every rank; the reported time is rank 0's median.
void BM_OSSAdam(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const auto sync = state.range(1) == 0 ? shardopt::ParamSync::kAllgather : shardopt::ParamSync::kBroadcast;
  std::mutex mu;
  std::vector<double> times;
  int64_t max_bytes = 0, min_bytes = INT64_MAX, total_bytes = 0, n = 0;
  double imbalance = 0;
  for (auto _ : state) {
    shardopt::testing::run_ranks(world, [&](std::shared_ptr<shardopt::ProcessGroup> g) {
      auto params = gpt2_like_params();
      shardopt::OSS opt(params, shardopt::optimizer<optim::Adam>(optim::AdamOptions(1e-3)), g,
                        shardopt::OSSOptions().sync(sync));
      for (int i = 0; i < kWarmup; ++i) opt.step();
      std::vector<double> mine;
      for (int i = 0; i < kSteps; ++i) {
        g->barrier();
        auto t0 = std::chrono::steady_clock::now();
        opt.step();
        mine.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::lock_guard<std::mutex> lock(mu);
      const int64_t b = opt.local_state_bytes();
      max_bytes = std::max(max_bytes, b), min_bytes = std::min(min_bytes, b), total_bytes += b;
      n = numel(params);
      imbalance = Introspection::imbalance(opt);
      if (g->rank() == 0) times = mine;
    });
    state.SetIterationTime(median(times));
  }
  state.counters["params"] = static_cast<double>(n);
  state.counters["state_bytes_per_rank"] = static_cast<double>(max_bytes);
  state.counters["min_state_bytes"] = static_cast<double>(min_bytes);
  // The largest shard relative to the ideal 1/world of the unsharded state.
  state.counters["max_over_ideal"] = static_cast<double>(max_bytes) * world / static_cast<double>(total_bytes / state.iterations());
  state.counters["fraction_of_unsharded"] = static_cast<double>(max_bytes) / static_cast<double>(total_bytes / state.iterations());
  state.counters["partition_imbalance"] = imbalance;
}
BENCHMARK(BM_OSSAdam)
    ->ArgNames({"world", "broadcast"})
    ->Args({1, 0})
    ->Args({2, 0})
    ->Args({2, 1})
    ->Args({4, 0})
    ->Args({4, 1})
    ->UseManualTime()
    ->Iterations(1)
    ->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
