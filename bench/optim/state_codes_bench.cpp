// The AdamW step on 8-bit moments (Note [8-bit state] in csrc/optim/state_codes.cpp: each block
// of 256 decoded, stepped and coded again) and on bf16 moments (Note [State formats] in
// csrc/optim/state_slabs.cpp: each block widened, stepped and rounded back) against the fused step
// on fp32 moments, over one 12M-element fp32 shard, in the widest build this CPU runs (argument:
// intra-op threads); and the 8-bit coder and decoder alone, in that build.
//
//   build/bench/state_codes_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include "csrc/optim/fused_kernels.h"
#include "csrc/optim/state_codes.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

namespace {

using namespace shardopt::detail;
constexpr int64_t kN = 12 << 20;  // 12,582,912 elements

AdamScalars scalars() {
  AdamScalars s;
  s.lr = 1e-3, s.beta1 = 0.9, s.beta2 = 0.999, s.eps = 1e-8, s.weight_decay = 0.01, s.decoupled = true;
  s.step_size = s.lr / (1 - 0.9), s.sqrt_bias_correction2 = std::sqrt(1 - 0.999);
  return s;
}

template <class Segment>
void step(const Segment& segment, const AdamScalars& s);
template <>
void step(const AdamSegment<float>& segment, const AdamScalars& s) {
  switch (cpu_kernel_level()) {
    case 3:
    case 2: return kernels_avx512::adam(&segment, 1, s);
    case 1: return kernels_avx2::adam(&segment, 1, s);
    default: return kernels_default::adam(&segment, 1, s);
  }
}
template <>
void step(const Adam8Segment& segment, const AdamScalars& s) { adam8_step(&segment, 1, s); }
template <>
void step(const Adam16Segment& segment, const AdamScalars& s) { adam16_step(&segment, 1, s); }

void BM_AdamWFp32Moments(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = at::randn({kN}) * 0.02, g = at::randn({kN}) * 1e-3, m = at::zeros({kN}), v = at::zeros({kN});
  const AdamSegment<float> segment{p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<float>(), v.data_ptr<float>(),
                                   nullptr, kN};
  const AdamScalars s = scalars();
  for (auto _ : state) step(segment, s);
  state.counters["state bytes/elem"] = 8;
}

void BM_AdamW8BitMoments(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = at::randn({kN}) * 0.02, g = at::randn({kN}) * 1e-3;
  at::Tensor m = at::zeros({kN}, at::kByte), v = at::zeros({kN}, at::kByte);
  at::Tensor ms = at::zeros({state_blocks(kN)}), vs = at::zeros({state_blocks(kN)});
  const Adam8Segment segment{p.data_ptr<float>(), g.data_ptr<float>(), m.data_ptr<uint8_t>(), ms.data_ptr<float>(),
                             v.data_ptr<uint8_t>(), vs.data_ptr<float>(), nullptr, nullptr, kN};
  const AdamScalars s = scalars();
  for (auto _ : state) step(segment, s);
  state.counters["state bytes/elem"] = 2 + 8.0 / kStateBlock;
}

void BM_AdamWBf16Moments(benchmark::State& state) {
  at::set_num_threads(static_cast<int>(state.range(0)));
  at::Tensor p = at::randn({kN}) * 0.02, g = at::randn({kN}) * 1e-3;
  at::Tensor m = at::zeros({kN}, at::kBFloat16), v = at::zeros({kN}, at::kBFloat16);
  auto bits = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
  const Adam16Segment segment{p.data_ptr<float>(), g.data_ptr<float>(), bits(m), bits(v), nullptr, kN};
  const AdamScalars s = scalars();
  for (auto _ : state) step(segment, s);
  state.counters["state bytes/elem"] = 4;
}

// The coder and the decoder alone, on 64 blocks (16,384 values) that stay in the L1 and L2 caches:
// what one block's two passes cost, apart from the step's memory traffic.
void BM_DecodeBlocks(benchmark::State& state) {
  std::vector<uint8_t> codes(64 * kStateBlock);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 37);
  std::vector<float> values(kStateBlock);
  const float* map = dynamic_map(true).data();
  for (auto _ : state) {
    for (int b = 0; b < 64; ++b) decode_block_fast(codes.data() + kStateBlock * b, kStateBlock, 0.5f, map, values.data());
    benchmark::DoNotOptimize(values.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(codes.size()));
}

void BM_CodeBlocks(benchmark::State& state) {
  const at::Tensor x = at::randn({64 * kStateBlock}) * 1e-3;
  std::vector<uint8_t> codes(64 * kStateBlock);
  const float* map = dynamic_map(true).data();
  for (auto _ : state) {
    for (int b = 0; b < 64; ++b) {
      quantise_block_fast(x.data_ptr<float>() + kStateBlock * b, kStateBlock, map, codes.data() + kStateBlock * b);
    }
    benchmark::DoNotOptimize(codes.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<int64_t>(codes.size()));
}

BENCHMARK(BM_DecodeBlocks);
BENCHMARK(BM_CodeBlocks);
BENCHMARK(BM_AdamWFp32Moments)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamWBf16Moments)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamW8BitMoments)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
