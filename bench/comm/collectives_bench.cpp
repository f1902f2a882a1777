// The collectives a data-parallel step can use, on one buffer the size of the GPT-2-shaped
// model (24.3M fp32 elements, 97 MB), two ranks as threads of this process over Gloo (loopback),
// one intra-op thread each: the gradient reduction (all-reduce as DDP, reduce of each half to its
// owner as ShardedDDP, reduce-scatter) and the parameter sync (broadcast of each half from its
// owner as OSS, all-gather; and both as rows). Median of 5 runs after one warm-up, rank 0's time. Also the mean at
// the owner, sum then div_ against reduce_mean_async, in pairs.
//
//   build/bench/collectives_bench --benchmark_counters_tabular=true
#include "median.h"

#include <shardopt/comm/process_group.h>

#include "harness.h"

#include <ATen/ATen.h>
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>

namespace {

constexpr int64_t kNumel = 24297472;
constexpr int kWarmup = 1, kRuns = 5;

using Collective = std::function<void(shardopt::ProcessGroup&, at::Tensor&)>;

using shardopt::bench::median;

void run(benchmark::State& state, const Collective& op) {
  std::mutex mu;
  std::vector<double> times;
  for (auto _ : state) {
    shardopt::testing::run_ranks(2, [&](std::shared_ptr<shardopt::ProcessGroup> g) {
      at::Tensor buf = at::rand({kNumel});
      std::vector<double> mine;
      for (int i = 0; i < kWarmup + kRuns; ++i) {
        g->barrier();
        auto t0 = std::chrono::steady_clock::now();
        op(*g, buf);
        if (i >= kWarmup) mine.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::lock_guard<std::mutex> lock(mu);
      if (g->rank() == 0) times = mine;
    });
    state.SetIterationTime(median(times));
  }
  state.counters["MB"] = kNumel * 4 / 1e6;
}

at::Tensor half(at::Tensor& buf, int r) {
  return buf.narrow(0, r * (kNumel / 2), kNumel / 2);
}

void BM_Allreduce(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) { g.allreduce(buf); });
}
void BM_ReduceEachHalfToItsOwner(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) {
    std::vector<shardopt::PendingWork> pending;
    std::vector<at::Tensor> halves{half(buf, 0), half(buf, 1)};
    for (int r = 0; r < 2; ++r) pending.push_back(g.reduce_async(halves[r], r));
    for (auto& w : pending) w.wait();
  });
}
void BM_ReduceScatter(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) {
    std::vector<at::Tensor> inputs{half(buf, 0), half(buf, 1)};
    at::Tensor out = at::empty({kNumel / 2});
    g.reduce_scatter(out, inputs);
  });
}
void BM_BroadcastEachHalfFromItsOwner(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) {
    std::vector<shardopt::PendingWork> pending;
    std::vector<at::Tensor> halves{half(buf, 0), half(buf, 1)};
    for (int r = 0; r < 2; ++r) pending.push_back(g.broadcast_async(halves[r], r));
    for (auto& w : pending) w.wait();
  });
}
void BM_Allgather(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) {
    std::vector<at::Tensor> outputs{half(buf, 0), half(buf, 1)};
    at::Tensor mine = outputs[g.rank()].clone();
    g.allgather(outputs, mine);
  });
}
// The same two steps as rows (Note [Rows]): one reduce-scatter and one all-gather of the buffer
// as one row per rank, direct transfers on Gloo.
void BM_ReduceScatterRows(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) { g.reduce_scatter_rows_async(buf).wait(); });
}
void BM_AllgatherRows(benchmark::State& state) {
  run(state, [](shardopt::ProcessGroup& g, at::Tensor& buf) { g.allgather_rows_async(buf).wait(); });
}

// The mean of each half at its owner, as ShardedDDP takes it: the sum then div_ on the owner's
// half, against reduce_mean_async (the division in the pass that sums). The two take turns on the
// same buffers (kPairs pairs, 2 ranks); counters: rank 0's medians and the median per-pair ratio
// (above 1: the fused mean is faster).
void BM_PairedMeanAtOwnerSumThenDivVsFused(benchmark::State& state) {
  constexpr int kPairs = 9;
  std::mutex mu;
  std::vector<double> separate, fused, ratios;
  for (auto _ : state) {
    shardopt::testing::run_ranks(2, [&](std::shared_ptr<shardopt::ProcessGroup> g) {
      at::Tensor buf = at::rand({kNumel});
      std::vector<at::Tensor> halves{half(buf, 0), half(buf, 1)};
      auto mean = [&](bool one_pass) {
        g->barrier();
        auto t0 = std::chrono::steady_clock::now();
        std::vector<shardopt::PendingWork> pending;
        for (int r = 0; r < 2; ++r) {
          pending.push_back(one_pass ? g->reduce_mean_async(halves[r], r, halves[r].numel(), 2.0)
                                     : g->reduce_async(halves[r], r));
        }
        for (auto& w : pending) w.wait();
        if (!one_pass) halves[g->rank()].div_(2.0);
        return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      };
      std::vector<double> a, b, q;
      mean(false), mean(true);  // warm-up
      for (int i = 0; i < kPairs; ++i) {
        a.push_back(mean(false));
        b.push_back(mean(true));
        q.push_back(a.back() / b.back());
      }
      std::lock_guard<std::mutex> lock(mu);
      if (g->rank() == 0) separate = a, fused = b, ratios = q;
    });
    state.SetIterationTime(median(fused));
  }
  state.counters["sum_then_div_ms"] = median(separate) * 1e3;
  state.counters["fused_ms"] = median(fused) * 1e3;
  state.counters["ratio"] = median(ratios);
}

#define COLLECTIVE(fn) BENCHMARK(fn)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond)
COLLECTIVE(BM_Allreduce);
COLLECTIVE(BM_ReduceEachHalfToItsOwner);
COLLECTIVE(BM_ReduceScatter);
COLLECTIVE(BM_BroadcastEachHalfFromItsOwner);
COLLECTIVE(BM_Allgather);
COLLECTIVE(BM_ReduceScatterRows);
COLLECTIVE(BM_AllgatherRows);
COLLECTIVE(BM_PairedMeanAtOwnerSumThenDivVsFused);

}  // namespace

BENCHMARK_MAIN();
