// The bf16 wire of the parameter sync (Note [Parameter wire] in csrc/comm/wire.cpp) at the process
// group: every rank, the sender included, ends with each sender's values as ATen's conversion to
// bf16 and back gives them, bit for bit: ties to even, signed zeros, subnormals, infinities, a
// finite value that rounds to infinity, and NaN (as a NaN). The stats count the bf16 bytes.
#include <shardopt/comm/process_group.h>

#include "harness.h"
#include "model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::run_ranks;

float from_bits(uint32_t bits) {
  float v;
  std::memcpy(&v, &bits, 4);
  return v;
}

// `rows` rows of `row` values for rank `rank`: random ones, each rank's own, with the cases above
// in every row.
at::Tensor values_of(int rank, int64_t row, int rows) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + rank);  // this rank's own (ranks are threads)
  at::Tensor x = at::randn({row * rows}, gen, at::kFloat);
  const float inf = std::numeric_limits<float>::infinity();
  const std::vector<float> special{
      from_bits(0x3f808000u),  // halfway between two bf16 values, the lower one even: rounds down
      from_bits(0x3f818000u),  // halfway, the lower one odd: rounds up
      from_bits(0x3f808001u),  // just above halfway
      0.0f,
      -0.0f,
      std::numeric_limits<float>::denorm_min(),
      -from_bits(0x00400000u),  // a subnormal bf16 keeps
      std::numeric_limits<float>::max(),  // rounds to infinity
      inf,
      -inf,
      std::numeric_limits<float>::quiet_NaN(),
      from_bits(0x7f800001u),  // a NaN that rounding its bits as a number would make infinity
  };
  for (int k = 0; k < rows; ++k) {
    for (size_t i = 0; i < special.size(); ++i) x[k * row + static_cast<int64_t>(7 * i) + rank] = special[i];
  }
  return x;
}

// `got` holds `sent` as bf16 delivers it: non-NaN bits equal to ATen's round trip, NaN where NaN.
::testing::AssertionResult delivered(const at::Tensor& got, const at::Tensor& sent) {
  const at::Tensor want = sent.to(at::kBFloat16).to(at::kFloat);
  const at::Tensor nan = want.isnan();
  if (!got.isnan().equal(nan)) return ::testing::AssertionFailure() << "NaN where ATen has none, or none where it has";
  const at::Tensor differ = got.view(at::kInt).ne(want.view(at::kInt)).logical_and_(nan.logical_not());
  if (differ.any().item<bool>()) {
    const int64_t i = differ.nonzero()[0][0].item<int64_t>();
    return ::testing::AssertionFailure() << "element " << i << ": sent " << sent[i].item<float>() << ", got "
                                         << got[i].item<float>() << ", ATen rounds to " << want[i].item<float>();
  }
  return ::testing::AssertionSuccess();
}

TEST(Bf16Wire, AllGatherAndBroadcastLeaveEveryRankAtenRounding) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      const int64_t row = 20000;  // more than one chunk of the rounding loop
      at::Tensor flat = values_of(r, row, world);
      const auto all = testing::everyones(*g, flat);
      for (int k = 1; k < world; ++k) {
        ASSERT_FALSE(all[k].view(at::kInt).equal(all[0].view(at::kInt))) << "ranks need different data";
      }
      const CommStats before = g->stats();
      g->allgather_rows_async(flat, at::kBFloat16).wait();
      EXPECT_EQ(g->stats().bytes[CommStats::kAllgather] - before.bytes[CommStats::kAllgather], world * row * 2);
      for (int k = 0; k < world; ++k) {
        ASSERT_TRUE(delivered(flat.narrow(0, k * row, row), all[k].narrow(0, k * row, row)))
            << "row " << k << " (this rank's own too) at world " << world << ", rank " << r;
      }
      at::Tensor t = all[r].narrow(0, 0, 333).clone();
      g->broadcast_async(t, world - 1, at::kBFloat16).wait();
      ASSERT_TRUE(delivered(t, all[world - 1].narrow(0, 0, 333))) << "the root's own too, rank " << r;
    });
  }
}

// With `own`, a rank's row is set from `own` through the wire: every rank holds each rank's `own`
// rounded as ATen rounds it; `own` is unchanged.
TEST(Bf16Wire, AllGatherOfAnotherTensorsValuesLeavesEveryRankThemRounded) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    const int64_t row = 1000;
    at::Tensor flat = values_of(g->rank(), row, 2);
    const at::Tensor own = values_of(g->rank() + 2, row, 1), own_before = own.clone();
    const auto owns = testing::everyones(*g, own);
    ASSERT_FALSE(owns[0].view(at::kInt).equal(owns[1].view(at::kInt))) << "ranks need different data";
    g->allgather_rows_async(flat, at::kBFloat16, own).wait();
    for (int k = 0; k < 2; ++k) ASSERT_TRUE(delivered(flat.narrow(0, k * row, row), owns[k])) << "row " << k;
    ASSERT_TRUE(own.view(at::kInt).equal(own_before.view(at::kInt))) << "own changed";
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
