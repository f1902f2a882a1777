// The AdamW step on 8-bit moments (Note [8-bit state] in csrc/optim/state_codes.cpp: each block
// of 256 decoded, stepped and coded again) and on bf16 moments (Note [State formats] in
// csrc/optim/state_slabs.cpp: each block widened, stepped and rounded back) against the fused step
// on fp32 moments, over one 12M-element fp32 shard, in the widest build this CPU runs. Argument:
// intra-op threads.
//
//   build/bench/state_codes_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include "csrc/optim/fused_kernels.h"
#include "csrc/optim/state_codes.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

#include <cmath>

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

BENCHMARK(BM_AdamWFp32Moments)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamWBf16Moments)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK(BM_AdamW8BitMoments)->Arg(1)->Arg(2)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
