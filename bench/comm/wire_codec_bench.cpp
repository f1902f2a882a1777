// The int8 and bf16 wires' codecs on one sender's row of the parameter sync (Note [Int8 wire],
// Note [Parameter wire] in csrc/comm/wire.cpp): pack the row for the wire, then set the row to what
// every receiver decodes, as two passes (encode_into, decode_into) against one (encode_rounding),
// over 12 Mi fp32 values (about one rank's row of the GPT-2 shape at two ranks), one thread; and
// the owner's sum of a row on the bf16 and int8 gradient wires.
//
//   build/bench/wire_codec_bench --benchmark_repetitions=3
#include "csrc/comm/sum_into.h"
#include "csrc/comm/wire_codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <benchmark/benchmark.h>

namespace {

constexpr int64_t kNumel = int64_t{12} << 20;

template <at::ScalarType kWire, bool kOnePass>
void BM_RowRounded(benchmark::State& state) {
  at::set_num_threads(1);
  const shardopt::detail::WireCodec codec(kWire);
  const at::Tensor x = at::randn({kNumel});
  at::Tensor row = x.clone();
  at::Tensor packed = at::empty({codec.packed_numel(kNumel)}, codec.packed_dtype());
  for (auto _ : state) {
    state.PauseTiming();
    row.copy_(x);  // the values a step wrote
    state.ResumeTiming();
    if (kOnePass) {
      codec.encode_rounding(row, packed);
    } else {
      codec.encode_into(row, packed);
      codec.decode_into(packed, row);
    }
    benchmark::DoNotOptimize(row.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 4);
}

BENCHMARK(BM_RowRounded<at::kChar, false>)->Name("BM_Int8RowRounded/encode_then_decode")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RowRounded<at::kChar, true>)->Name("BM_Int8RowRounded/one_pass")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RowRounded<at::kBFloat16, false>)
    ->Name("BM_Bf16RowRounded/encode_then_decode")
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_RowRounded<at::kBFloat16, true>)->Name("BM_Bf16RowRounded/one_pass")->Unit(benchmark::kMillisecond);

// The owner's sum on the bf16 gradient wire (Note [Gradient wire]): its own fp32 row rounded to
// bf16 and widened, plus one bf16 row that arrived, divided by the world size, into fp32. With
// ATen's operators (a cast each way, add_, div_) against the one-pass loop ShardedDDP runs.
template <bool kOnePass>
void BM_Bf16OwnerSum(benchmark::State& state) {
  at::set_num_threads(1);
  const at::Tensor own = at::randn({kNumel});
  const std::vector<at::Tensor> incoming{at::randn({kNumel}).to(at::kBFloat16)};
  at::Tensor out = at::empty({kNumel});
  for (auto _ : state) {
    if (kOnePass) {
      shardopt::detail::sum_widened(out, own, incoming, kNumel, 2.0);
    } else {
      out.copy_(own.to(at::kBFloat16));
      out.add_(incoming[0]).div_(2.0);
    }
    benchmark::DoNotOptimize(out.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 4);
}

BENCHMARK(BM_Bf16OwnerSum<false>)->Name("BM_Bf16OwnerSum/aten")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Bf16OwnerSum<true>)->Name("BM_Bf16OwnerSum/one_pass")->Unit(benchmark::kMillisecond);

// The same on the int8 wire (Note [Int8 wire]): its own row quantised and dequantised, plus one
// packed row that arrived, dequantised, divided by the world size, in one pass.
void BM_Int8OwnerSum(benchmark::State& state) {
  at::set_num_threads(1);
  const shardopt::detail::WireCodec codec(at::kChar);
  const at::Tensor own = at::randn({kNumel});
  const std::vector<at::Tensor> incoming{codec.encode(at::randn({kNumel}))};
  at::Tensor out = at::empty({kNumel});
  for (auto _ : state) {
    shardopt::detail::sum_decoded(out, own, incoming, codec, kNumel, 2.0);
    benchmark::DoNotOptimize(out.data_ptr());
  }
  state.SetBytesProcessed(state.iterations() * kNumel * 4);
}

BENCHMARK(BM_Int8OwnerSum)->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
