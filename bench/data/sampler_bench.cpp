// BalancedSampler against LibTorch's DistributedRandomSampler (which materialises and shuffles
// all N indices on every rank at construction and at every epoch).
//
//   Construct/N   time to a sampler ready to serve epoch 0; counter bytes_held = bytes the
//                 sampler keeps allocated (counted by replacing operator new in this program).
//   Epoch/N       one whole epoch of one rank (rank 3 of 8, batch 256), including the per-epoch
//                 reshuffle; items_per_second = indices served per second.
//   RandomStep/N  batch(step) at random steps (only BalancedSampler has random access).
//
// Run: build/bench/sampler_bench --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
#include <shardopt/data/sampler.h>

#include <benchmark/benchmark.h>
#include <torch/data/samplers/distributed.h>

#include <malloc.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <optional>
#include <vector>

// Live bytes allocated through operator new, by anyone in the process (LibTorch included): the
// memory counter below is the growth of this while a sampler exists.
namespace {
std::atomic<int64_t> live_bytes{0};
}  // namespace

void* operator new(size_t size) {
  void* p = std::malloc(size ? size : 1);
  if (!p) throw std::bad_alloc();
  live_bytes += static_cast<int64_t>(malloc_usable_size(p));
  return p;
}
void operator delete(void* p) noexcept {
  if (!p) return;
  live_bytes -= static_cast<int64_t>(malloc_usable_size(p));
  std::free(p);
}
void operator delete(void* p, size_t) noexcept {
  operator delete(p);
}

namespace {

int64_t heap_bytes() {
  return live_bytes.load();
}

constexpr int kWorld = 8;
constexpr int kRank = 3;
constexpr int64_t kBatch = 256;
constexpr int64_t kRowsPerChunk = 65536;

shardopt::SamplerOptions options_for(int64_t n, bool chunked) {
  auto options = shardopt::SamplerOptions(kBatch).seed(1);
  if (chunked) {
    std::vector<int64_t> sizes(n / kRowsPerChunk, kRowsPerChunk);
    if (n % kRowsPerChunk) sizes.push_back(n % kRowsPerChunk);
    options.chunk_sizes(sizes).window_chunks(8);
  }
  return options;
}

void set_bytes_held(benchmark::State& state, int64_t bytes) {
  state.counters["bytes_held"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kDefaults, benchmark::Counter::kIs1024);
}

// ---- construction and memory ------------------------------------------------------------------

void BM_Balanced_Construct(benchmark::State& state, bool chunked) {
  const int64_t n = state.range(0);
  const auto options = options_for(n, chunked);  // the chunk list is the caller's data: not counted
  int64_t bytes = 0;
  for (auto _ : state) {
    const int64_t before = heap_bytes();
    shardopt::BalancedSampler sampler(n, kRank, kWorld, options);
    bytes = heap_bytes() - before;
    benchmark::DoNotOptimize(sampler.steps_per_epoch());
  }
  set_bytes_held(state, bytes);
}

void BM_Torch_Construct(benchmark::State& state) {
  const int64_t n = state.range(0);
  int64_t bytes = 0;
  for (auto _ : state) {
    const int64_t before = heap_bytes();
    torch::data::samplers::DistributedRandomSampler sampler(n, kWorld, kRank);
    bytes = heap_bytes() - before;
    benchmark::DoNotOptimize(sampler.index());
  }
  set_bytes_held(state, bytes);
}

// ---- serving an epoch -------------------------------------------------------------------------

void BM_Balanced_Epoch(benchmark::State& state, bool chunked) {
  const int64_t n = state.range(0);
  shardopt::BalancedSampler sampler(n, kRank, kWorld, options_for(n, chunked));
  int64_t epoch = 0, served = 0;
  for (auto _ : state) {
    sampler.set_epoch(++epoch);
    for (int64_t t = 0; t < sampler.steps_per_epoch(); ++t) {
      shardopt::Batch b = sampler.batch(t);
      benchmark::DoNotOptimize(b.indices.data());
      served += kBatch;
    }
  }
  state.SetItemsProcessed(served);
}

void BM_Torch_Epoch(benchmark::State& state) {
  const int64_t n = state.range(0);
  torch::data::samplers::DistributedRandomSampler sampler(n, kWorld, kRank);
  size_t epoch = 0;
  int64_t served = 0;
  for (auto _ : state) {
    sampler.set_epoch(++epoch);
    sampler.reset();
    while (std::optional<std::vector<size_t>> b = sampler.next(kBatch)) {
      benchmark::DoNotOptimize(b->data());
      served += static_cast<int64_t>(b->size());
    }
  }
  state.SetItemsProcessed(served);
}

void BM_Balanced_RandomStep(benchmark::State& state, bool chunked) {
  const int64_t n = state.range(0);
  shardopt::BalancedSampler sampler(n, kRank, kWorld, options_for(n, chunked));
  const uint64_t steps = static_cast<uint64_t>(sampler.steps_per_epoch());
  uint64_t i = 0;
  for (auto _ : state) {
    const int64_t step = static_cast<int64_t>((++i * 0x9E3779B97F4A7C15ULL >> 11) % steps);
    shardopt::Batch b = sampler.batch(step);
    benchmark::DoNotOptimize(b.indices.data());
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations()) * kBatch);
}

void sizes(benchmark::internal::Benchmark* b) {
  b->Arg(10'000)->Arg(1'000'000)->Arg(100'000'000)->Unit(benchmark::kMillisecond);
}

BENCHMARK_CAPTURE(BM_Balanced_Construct, plain, false)->Apply(sizes)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Balanced_Construct, chunked, true)->Apply(sizes)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_Torch_Construct)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Balanced_Epoch, plain, false)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Balanced_Epoch, chunked, true)->Apply(sizes);
BENCHMARK(BM_Torch_Epoch)->Apply(sizes);
BENCHMARK_CAPTURE(BM_Balanced_RandomStep, plain, false)->Apply(sizes)->Unit(benchmark::kMicrosecond);
BENCHMARK_CAPTURE(BM_Balanced_RandomStep, chunked, true)->Apply(sizes)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
