// The int8 wire (Note [Int8 wire] in csrc/comm/wire.cpp) at the process group: rows reduce-
// scattered, reduced to one owner, all-gathered and broadcast as int8 blocks of 256 elements with
// one fp32 scale each, against a quantisation written here from its definition (scale = max |x| /
// 127 per block, q = round(x / scale), x' = q * scale) over every rank's data: the owners' sums,
// bit for bit, of every contribution dequantised (its own too), its own first then the others by
// rank, divided after the sum; a row's exact tail (ShardedDDP's flags) arrives unchanged; every
// rank ends with the same dequantised parameters; the stats count the packed bytes. The reductions
// run both ways a group takes them: Gloo's direct transfers, and the all-to-all and gather NCCL
// takes (Note [Int8 wire on collectives], here on Gloo), each one collective in the stats.
#include <shardopt/comm/process_group.h>
#include <shardopt/testing/introspection.h>

#include "harness.h"
#include "model.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::run_ranks;

constexpr int64_t kBlock = 256;

// x (1-D fp32) as the int8 wire delivers it, its last `tail` elements exact.
at::Tensor quantised(const at::Tensor& x, int64_t tail = 0) {
  const int64_t n = x.numel() - tail;
  at::Tensor out = x.clone();
  for (int64_t b = 0; b < n; b += kBlock) {
    at::Tensor block = x.narrow(0, b, std::min(kBlock, n - b));
    float scale = block.abs().max().item<float>() / 127.0f;
    if (scale == 0) scale = 1;
    const at::Tensor s = at::full({1}, scale, at::kFloat);
    out.narrow(0, b, block.numel()).copy_(at::round(block / s).clamp(-127, 127) * s);
  }
  return out;
}

// Every rank's copy of `mine`; each rank's data differs (asserted).
std::vector<at::Tensor> everyones(ProcessGroup& g, const at::Tensor& mine) {
  auto all = testing::everyones(g, mine);
  for (int k = 1; k < g.size(); ++k) EXPECT_FALSE(all[k].equal(all[0])) << "ranks need different data";
  return all;
}

int64_t packed_bytes(int64_t n, int64_t tail = 0) {
  return (n - tail) + 4 * ((n - tail + kBlock - 1) / kBlock) + 4 * tail;
}

// Error feedback's step on one row (Note [Error feedback]), against its definition: v = x plus the
// bf16 residual, x' = v as the wire delivers it, residual' = v - x' rounded to bf16. On the CPU
// the step is one pass over memory; it must give these bits exactly, over full blocks, a block of
// zeros, a block of tiny values, and a short last block, on the int8 wire and on the bf16 wire.
TEST(Int8Wire, ErrorFeedbackInOnePassGivesTheBitsOfItsDefinition) {
  const int64_t n = 4 * kBlock + 97;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);  // this rank's own (ranks are threads)
  at::Tensor x = at::randn({n}, gen, at::kFloat);
  x.narrow(0, kBlock, kBlock).zero_();
  x.narrow(0, 2 * kBlock, kBlock).mul_(1e-30);
  x.narrow(0, 3 * kBlock, kBlock).mul_(1e4);
  const at::Tensor residual = (at::randn({n}, gen, at::kFloat) * 1e-2).to(at::kBFloat16);
  for (Wire wire : {Wire::kInt8, Wire::kBFloat16}) {
    SCOPED_TRACE(wire == Wire::kInt8 ? "int8" : "bf16");
    const at::Tensor v = x + residual.to(at::kFloat);
    const at::Tensor sent = wire == Wire::kInt8 ? quantised(v) : v.to(at::kBFloat16).to(at::kFloat);
    const at::Tensor dropped = (v - sent).to(at::kBFloat16);
    at::Tensor got = x.clone(), kept = residual.clone();
    testing::Introspection::feed_back(wire, got, kept);
    EXPECT_TRUE(got.equal(sent));
    EXPECT_TRUE(kept.view(at::kShort).equal(dropped.view(at::kShort)));
    EXPECT_FALSE(kept.view(at::kShort).equal(residual.view(at::kShort)));  // (something was dropped)
  }
}

// The two ways a group reduces on the int8 wire.
enum class Route { kDirect, kCollectives };
const char* name(Route route) { return route == Route::kDirect ? "direct transfers" : "all-to-all and gather"; }
void take(Route route, ProcessGroup& g) {
  if (route == Route::kCollectives) testing::Introspection::wire_by_collectives(g);
}

TEST(Int8Wire, RowsReduceScatterSumsTheDequantisedBlocksInFp32) {
  for (Route route : {Route::kDirect, Route::kCollectives}) {
    for (int world : {2, 3, 4}) {
      SCOPED_TRACE(std::string(name(route)) + ", world " + std::to_string(world));
      run_ranks(world, [world, route](std::shared_ptr<ProcessGroup> g) {
        take(route, *g);
        const int r = g->rank();
        const int64_t row = 1000, tail = 3;  // 997 values (not a multiple of 256) then 3 exact flags
        auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + r);  // this rank's own (ranks are threads)
        at::Tensor flat = at::randn({row * world}, gen) * (r + 1);
        for (int k = 0; k < world; ++k) flat.narrow(0, k * row + row - tail, tail).fill_(1.0 + r);
        const auto all = everyones(*g, flat);
        for (bool into : {false, true}) {
          at::Tensor buf = flat.clone();
          at::Tensor out = at::empty({row});
          const CommStats before = g->stats();
          if (into) {
            out.copy_(buf.narrow(0, r * row, row));
            g->reduce_scatter_rows_into_async(buf, out, world, at::kChar, tail).wait();
          } else {
            g->reduce_scatter_rows_async(buf, world, {}, at::kChar, tail).wait();
            out = buf.narrow(0, r * row, row);
          }
          EXPECT_EQ(g->stats().bytes[CommStats::kReduceScatter] - before.bytes[CommStats::kReduceScatter],
                    world * packed_bytes(row, tail));
          EXPECT_EQ(g->stats().total_calls() - before.total_calls(), 1) << "one collective";
          at::Tensor want = quantised(all[r].narrow(0, r * row, row), tail);
          for (int k = 0; k < world; ++k) {
            if (k != r) want = want + quantised(all[k].narrow(0, r * row, row), tail);
          }
          want = want / static_cast<double>(world);
          ASSERT_TRUE(out.equal(want)) << (into ? "into: " : "") << "max diff "
                                       << (out - want).abs().max().item<double>();
          // The flags are sums of exact values: (1 + 2 + ... + world) / world.
          EXPECT_TRUE(out.narrow(0, row - tail, tail).eq((world + 1) / 2.0).all().item<bool>());
          at::Tensor exact = at::zeros({row});
          for (int k = 0; k < world; ++k) exact += all[k].narrow(0, r * row, row);
          EXPECT_FALSE(out.equal(exact / static_cast<double>(world))) << "int8 rounded nothing";
        }
      });
    }
  }
}

// Under mixed precision a bucket is bf16: every contribution is still dequantised and summed in
// fp32, in the same order, and the mean is rounded to bf16 once (Note [Int8 wire]), on the rows'
// reduce-scatter and on the reduce to one owner. Summing in bf16 instead rounds every partial sum
// and every dequantised value, and gives other bits.
TEST(Int8Wire, ABf16BucketIsSummedInFp32AndRoundedOnce) {
  for (Route route : {Route::kDirect, Route::kCollectives}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(name(route)) + ", world " + std::to_string(world));
      run_ranks(world, [world, route](std::shared_ptr<ProcessGroup> g) {
        take(route, *g);
        const int r = g->rank();
        const int64_t row = 700;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + r);  // this rank's own (ranks are threads)
        const at::Tensor flat = (at::randn({row * world}, gen) * (r + 1)).to(at::kBFloat16);
        const auto all = everyones(*g, flat);
        // The mean rank `owner` gets of elements [begin, begin + n) of everyone's `flat`: in fp32,
        // its own first; and the same summed in bf16, as a bf16 bucket's own dtype would.
        auto mean = [&](int owner, int64_t begin, int64_t n, at::ScalarType in) {
          at::Tensor sum = quantised(all[owner].narrow(0, begin, n).to(at::kFloat)).to(in);
          for (int k = 0; k < world; ++k) {
            if (k != owner) sum = sum + quantised(all[k].narrow(0, begin, n).to(at::kFloat)).to(in);
          }
          return (sum / static_cast<double>(world)).to(at::kBFloat16);
        };
        at::Tensor rows = flat.clone();
        g->reduce_scatter_rows_async(rows, world, {}, at::kChar).wait();
        const at::Tensor got = rows.narrow(0, r * row, row), want = mean(r, r * row, row, at::kFloat);
        ASSERT_TRUE(got.equal(want)) << "rows: max diff " << (got.to(at::kFloat) - want.to(at::kFloat)).abs().max();
        EXPECT_FALSE(got.equal(mean(r, r * row, row, at::kBFloat16))) << "the test must tell fp32 sums from bf16";
        at::Tensor whole = flat.narrow(0, 0, row).clone();
        g->reduce_mean_async(whole, 0, row, world, at::kChar).wait();
        if (r == 0) {
          ASSERT_TRUE(whole.equal(mean(0, 0, row, at::kFloat))) << "reduce to one owner";
        }
      });
    }
  }
}

// A double bucket is summed in double (Note [Int8 wire]): the mean of the dequantised blocks,
// not fp32 values widened, on the rows' reduce-scatter and on the reduce to one owner.
TEST(Int8Wire, ADoubleBucketIsSummedInDouble) {
  for (Route route : {Route::kDirect, Route::kCollectives}) {
    for (int world : {2, 3}) {
      SCOPED_TRACE(std::string(name(route)) + ", world " + std::to_string(world));
      run_ranks(world, [world, route](std::shared_ptr<ProcessGroup> g) {
        take(route, *g);
        const int r = g->rank();
        const int64_t row = 700;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(950 + r);  // this rank's own (ranks are threads)
        const at::Tensor flat = at::randn({row * world}, gen, at::kDouble) * (r + 1);
        const auto all = everyones(*g, flat);
        auto mean = [&](int64_t begin, int64_t n) {
          at::Tensor sum = at::zeros({n}, at::kDouble);
          for (int k = 0; k < world; ++k) sum += quantised(all[k].narrow(0, begin, n).to(at::kFloat)).to(at::kDouble);
          return sum / static_cast<double>(world);
        };
        auto check = [](const at::Tensor& got, const at::Tensor& want, const char* what) {
          EXPECT_EQ(got.scalar_type(), at::kDouble) << what;
          EXPECT_LT((got - want).abs().max().item<double>(), 1e-5) << what << ": the dequantised mean";
          EXPECT_FALSE(got.equal(got.to(at::kFloat).to(at::kDouble))) << what << ": summed in fp32, then widened";
        };
        at::Tensor rows = flat.clone();
        g->reduce_scatter_rows_async(rows, world, {}, at::kChar).wait();
        check(rows.narrow(0, r * row, row), mean(r * row, row), "rows");
        at::Tensor whole = flat.narrow(0, 0, row).clone();
        g->reduce_mean_async(whole, 0, row, world, at::kChar).wait();
        if (r == 0) check(whole, mean(0, row), "reduce to one owner");
      });
    }
  }
}

// A block with inf or NaN arrives all NaN (the gradient scaler must see it); the other blocks
// arrive within half a step of their scale.
TEST(Int8Wire, ABlockWithInfOrNanArrivesNonFinite) {
  for (Route route : {Route::kDirect, Route::kCollectives}) {
    SCOPED_TRACE(name(route));
    run_ranks(2, [route](std::shared_ptr<ProcessGroup> g) {
      take(route, *g);
      for (double bad : {std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(800 + g->rank());  // this rank's own (ranks are threads)
        at::Tensor flat = at::randn({2 * 600}, gen);
        const auto all = everyones(*g, flat);
        flat[10] = bad;  // in rank 0's row, block 0, on every rank
        g->reduce_scatter_rows_async(flat, 2.0, {}, at::kChar).wait();
        if (g->rank() != 0) continue;
        const at::Tensor row = flat.narrow(0, 0, 600);
        EXPECT_TRUE(row.narrow(0, 0, kBlock).isnan().all().item<bool>()) << bad;
        const at::Tensor rest = row.narrow(0, kBlock, 600 - kBlock);
        EXPECT_TRUE(rest.isfinite().all().item<bool>()) << bad;
        const at::Tensor exact =
            (all[0].narrow(0, kBlock, 600 - kBlock) + all[1].narrow(0, kBlock, 600 - kBlock)) / 2.0;
        const double largest = std::max(all[0].abs().max().item<double>(), all[1].abs().max().item<double>());
        EXPECT_LE((rest - exact).abs().max().item<double>(), largest / 254 * 1.0001) << bad;
      }
    });
  }
}

// The round trip of each block on its own (a broadcast: the root keeps what it sends, as every
// receiver decodes it): every element within half of its own block's step, max |block| / 254, over
// blocks of every magnitude (ordinary, 1e-30, 1e30, all zeros: exact) and a short last block; a
// block holding inf or NaN arrives all NaN, and its neighbours as if it were not there.
TEST(Int8Wire, EveryBlockRoundTripsWithinHalfItsOwnStep) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    const int64_t n = 7 * kBlock + 45;
    // The same on both ranks (a generator of its own: the ranks are threads of one process), so
    // that rank 1 checks what it receives too.
    const at::Tensor x = at::randn({n}, at::make_generator<at::CPUGeneratorImpl>(1000));
    x.narrow(0, 1 * kBlock, kBlock).mul_(1e-30);
    x.narrow(0, 2 * kBlock, kBlock).mul_(1e30);
    x.narrow(0, 3 * kBlock, kBlock).zero_();
    x[4 * kBlock + 7] = std::numeric_limits<float>::infinity();
    x[5 * kBlock + 100] = std::numeric_limits<float>::quiet_NaN();
    at::Tensor t = g->rank() == 0 ? x.clone() : at::zeros({n});
    g->broadcast_async(t, 0, at::kChar).wait();
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t len = std::min(kBlock, n - b);
      const at::Tensor in = x.narrow(0, b, len), out = t.narrow(0, b, len);
      const std::string where = "rank " + std::to_string(g->rank()) + ", block " + std::to_string(b / kBlock);
      if (!in.isfinite().all().item<bool>()) {
        EXPECT_TRUE(out.isnan().all().item<bool>()) << where;
        continue;
      }
      const double half_step = in.abs().max().item<double>() / 254;
      const double err = (out.to(at::kDouble) - in.to(at::kDouble)).abs().max().item<double>();
      EXPECT_LE(err, half_step * (1 + 1e-6)) << where;
      if (half_step == 0) EXPECT_TRUE(out.equal(in)) << where << ": zeros arrive as zeros";
      if (b / kBlock != 3) EXPECT_GT(err, 0) << where << ": something was rounded";
    }
  });
}

TEST(Int8Wire, ReduceToOneOwnerSumsTheDequantisedBlocks) {
  for (Route route : {Route::kDirect, Route::kCollectives}) {
    SCOPED_TRACE(name(route));
    run_ranks(3, [route](std::shared_ptr<ProcessGroup> g) {
      take(route, *g);
      const int r = g->rank();
      const int64_t n = 700, tail = 2;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(600 + r);  // this rank's own (ranks are threads)
      at::Tensor t = at::randn({n}, gen);
      const auto all = everyones(*g, t);
      const CommStats before = g->stats();
      g->reduce_mean_async(t, 1, n - tail, 3.0, at::kChar, tail).wait();
      EXPECT_EQ(g->stats().bytes[CommStats::kReduce] - before.bytes[CommStats::kReduce], packed_bytes(n, tail));
      EXPECT_EQ(g->stats().total_calls() - before.total_calls(), 1) << "one collective";
      if (r != 1) return;
      at::Tensor want = quantised(all[1], tail) + quantised(all[0], tail) + quantised(all[2], tail);
      want.narrow(0, 0, n - tail).div_(3.0);
      ASSERT_TRUE(t.equal(want)) << "max diff " << (t - want).abs().max().item<double>();
    });
  }
}

TEST(Int8Wire, AllGatherAndBroadcastLeaveEveryRankTheDequantisedValues) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      const int64_t row = 600;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + r);  // this rank's own (ranks are threads)
      at::Tensor flat = at::randn({row * world}, gen);
      const auto all = everyones(*g, flat);
      const CommStats before = g->stats();
      g->allgather_rows_async(flat, at::kChar).wait();
      EXPECT_EQ(g->stats().bytes[CommStats::kAllgather] - before.bytes[CommStats::kAllgather],
                world * packed_bytes(row));
      for (int k = 0; k < world; ++k) {
        const at::Tensor want = quantised(all[k].narrow(0, k * row, row));
        ASSERT_TRUE(flat.narrow(0, k * row, row).equal(want)) << "row " << k << ", this rank's own too";
      }
      at::Tensor t = all[r].narrow(0, 0, 333).clone();
      g->broadcast_async(t, world - 1, at::kChar).wait();
      ASSERT_TRUE(t.equal(quantised(all[world - 1].narrow(0, 0, 333)))) << "the root's own too";
    });
  }
}

// With `own`, a rank packs its row from `own` and sets its row of `flat` to what the others
// decode: every rank, the sender included, holds each rank's `own` dequantised; `own` is unchanged.
TEST(Int8Wire, AllGatherOfAnotherTensorsValuesLeavesEveryRankThemDequantised) {
  run_ranks(3, [](std::shared_ptr<ProcessGroup> g) {
    const int64_t row = 600;
    auto gen = at::make_generator<at::CPUGeneratorImpl>(800 + g->rank());  // this rank's own (ranks are threads)
    at::Tensor flat = at::randn({row * 3}, gen);
    const at::Tensor own = at::randn({row}, gen) * 3, own_before = own.clone();
    const auto owns = everyones(*g, own);
    g->allgather_rows_async(flat, at::kChar, own).wait();
    for (int k = 0; k < 3; ++k) {
      ASSERT_TRUE(flat.narrow(0, k * row, row).equal(quantised(owns[k]))) << "row " << k << ", this rank's own too";
    }
    ASSERT_TRUE(own.equal(own_before));
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
