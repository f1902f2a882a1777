// ProcessGroup's rows (Note [Rows]): one reduce-scatter and one all-gather over a flat buffer cut
// into one equal row per rank, against sums and gathers computed here from every rank's data.
#include <shardopt/comm/process_group.h>

#include "harness.h"
#include "model.h"

#include <c10/util/Exception.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::run_ranks;

// Every rank's copy of `mine`; each rank's data differs (asserted).
std::vector<at::Tensor> everyones(ProcessGroup& g, const at::Tensor& mine) {
  auto all = testing::everyones(g, mine);
  for (int k = 1; k < g.size(); ++k) EXPECT_FALSE(all[k].equal(all[0])) << "ranks need different data";
  return all;
}

// Rank r's row after the reduce-scatter is the sum of every rank's row r, its own first and then
// the others in rank order, divided by the divisor: bit for bit (float, double through the
// one-pass loop; bfloat16 through ATen's operators). The all-gather then gives every rank each
// owner's row. One collective each in stats(), counting the buffer's bytes.
TEST(Rows, ReduceScatterSumsEachRowOnItsOwnerAndAllGatherSpreadsThem) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
        for (double divisor : {1.0, static_cast<double>(world)}) {
          const int64_t row = 20011;  // odd: the sum's chunks do not divide it
          auto gen = at::make_generator<at::CPUGeneratorImpl>(200 + r);  // this rank's own (ranks are threads)
          at::Tensor flat = at::randn({row * world}, gen, at::kDouble).to(dtype);
          const std::vector<at::Tensor> all = everyones(*g, flat);
          g->reset_stats();
          g->reduce_scatter_rows_async(flat, divisor).wait();
          at::Tensor expected = all[r].narrow(0, r * row, row).clone();
          for (int k = 0; k < world; ++k) {
            if (k != r) expected.add_(all[k].narrow(0, r * row, row));
          }
          if (divisor != 1.0) expected.div_(divisor);
          at::Tensor mine = flat.narrow(0, r * row, row);
          EXPECT_TRUE(mine.equal(expected)) << "world " << world << " " << dtype << " divisor " << divisor
                                            << ": max diff " << (mine - expected).abs().max().item<double>();
          // Each owner's row, now different on every rank, reaches every rank.
          mine.copy_(at::randn({row}, gen, at::kDouble).to(dtype));
          const std::vector<at::Tensor> owned = everyones(*g, mine.clone());
          g->allgather_rows_async(flat).wait();
          for (int k = 0; k < world; ++k) {
            EXPECT_TRUE(flat.narrow(0, k * row, row).equal(owned[k])) << "row " << k << " on rank " << r;
          }
          EXPECT_EQ(g->stats().calls[CommStats::kReduceScatter], 1);
          EXPECT_EQ(g->stats().calls[CommStats::kAllgather], 1 + 1);  // everyones() is the other
          EXPECT_EQ(g->stats().bytes[CommStats::kReduceScatter], flat.numel() * flat.element_size());
        }
      }
    });
  }
}

// With this rank's contribution in an output row of its own (reduce_scatter_rows_into_async, as
// ShardedDDP keeps a rank's own gradients where they live): the same sum, bit for bit, in that
// output, whatever this rank's row of the buffer holds; and an output row to receive the sum
// while the own contribution stays in the buffer (reduce_scatter_rows_async's `out`).
TEST(Rows, ReduceScatterIntoAnOutputRowSumsTheSameBits) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      for (double divisor : {1.0, static_cast<double>(world)}) {
        const int64_t row = 5003;
        auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + r);  // this rank's own (ranks are threads)
        at::Tensor flat = at::randn({row * world}, gen);
        const std::vector<at::Tensor> all = everyones(*g, flat);
        at::Tensor expected = all[r].narrow(0, r * row, row).clone();
        for (int k = 0; k < world; ++k) {
          if (k != r) expected.add_(all[k].narrow(0, r * row, row));
        }
        if (divisor != 1.0) expected.div_(divisor);
        // Own contribution in `out`; this rank's row of the buffer holds something else.
        at::Tensor out = flat.narrow(0, r * row, row).clone();
        at::Tensor scratch = flat.clone();
        scratch.narrow(0, r * row, row).fill_(12345.0);
        g->reduce_scatter_rows_into_async(scratch, out, divisor).wait();
        EXPECT_TRUE(out.equal(expected)) << "into, world " << world << " divisor " << divisor;
        // Own contribution in the buffer, the sum to `out`.
        at::Tensor to = at::empty({row});
        at::Tensor again = flat.clone();
        g->reduce_scatter_rows_async(again, divisor, to).wait();
        EXPECT_TRUE(to.equal(expected)) << "to, world " << world << " divisor " << divisor;
      }
    });
  }
}

// Several rows collectives in flight at once (as buckets become ready in backward), waited in
// another order than they were started: each gets its own transfers.
TEST(Rows, SeveralInFlightAtOnceKeepTheirData) {
  run_ranks(3, [](std::shared_ptr<ProcessGroup> g) {
    const int r = g->rank();
    std::vector<at::Tensor> flats;
    for (int b = 0; b < 4; ++b) flats.push_back(at::full({3 * (b + 1)}, 10.0 * b + r + 1));
    std::vector<PendingWork> works;
    for (auto& f : flats) works.push_back(g->reduce_scatter_rows_async(f));
    for (int b = 3; b >= 0; --b) works[b].wait();
    for (int b = 0; b < 4; ++b) {
      const int64_t row = b + 1;
      // (10b + 1) + (10b + 2) + (10b + 3) in every element of this rank's row
      EXPECT_TRUE(flats[b].narrow(0, r * row, row).equal(at::full({row}, 30.0 * b + 6))) << "bucket " << b;
    }
  });
}

// At a power-of-two size of 8 or more, small rows go in log2(size) rounds (Note [Row rounds]):
// every rank's row is the sum over ranks, exactly (whole numbers, so any order of summing gives
// the same bits) and, for random data, to float's rounding; the own contribution may sit in an
// output row; one collective each in stats(), counting the buffer's bytes.
TEST(Rows, RoundsAtPowerOfTwoSizesSumEachRowOnItsOwner) {
  for (int world : {8, 16}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      const int64_t row = 1001;  // 4 KB of float: rounds
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
        for (double divisor : {1.0, static_cast<double>(world)}) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(400 + r);  // this rank's own (ranks are threads)
          at::Tensor flat = at::randint(-8, 9, {row * world}, gen, at::kDouble).to(dtype);
          const std::vector<at::Tensor> all = everyones(*g, flat);
          at::Tensor expected = at::zeros({row}, at::kDouble);
          for (int k = 0; k < world; ++k) expected.add_(all[k].narrow(0, r * row, row).to(at::kDouble));
          expected = (expected / divisor).to(dtype);
          g->reset_stats();
          at::Tensor plain = flat.clone();
          g->reduce_scatter_rows_async(plain, divisor).wait();
          EXPECT_TRUE(plain.narrow(0, r * row, row).equal(expected)) << "world " << world << " " << dtype;
          EXPECT_EQ(g->stats().calls[CommStats::kReduceScatter], 1);
          EXPECT_EQ(g->stats().bytes[CommStats::kReduceScatter], flat.numel() * flat.element_size());
          at::Tensor to = at::empty({row}, flat.options());
          at::Tensor again = flat.clone();
          g->reduce_scatter_rows_async(again, divisor, to).wait();
          EXPECT_TRUE(to.equal(expected)) << "to, world " << world << " " << dtype;
          at::Tensor out = flat.narrow(0, r * row, row).clone();
          at::Tensor elsewhere = flat.clone();
          elsewhere.narrow(0, r * row, row).fill_(100);
          g->reduce_scatter_rows_into_async(elsewhere, out, divisor).wait();
          EXPECT_TRUE(out.equal(expected)) << "into, world " << world << " " << dtype;
          EXPECT_TRUE(elsewhere.narrow(0, r * row, row).equal(at::full({row}, 100, flat.options())))
              << "the own row of the buffer is left alone";
          // Each owner's row, different on every rank, reaches every rank.
          at::Tensor owned_row = at::randint(-8, 9, {row}, gen, at::kDouble).to(dtype);
          plain.narrow(0, r * row, row).copy_(owned_row);
          const std::vector<at::Tensor> owned = everyones(*g, owned_row);
          g->reset_stats();
          g->allgather_rows_async(plain).wait();
          for (int k = 0; k < world; ++k) {
            EXPECT_TRUE(plain.narrow(0, k * row, row).equal(owned[k])) << "row " << k << " on rank " << r;
          }
          EXPECT_EQ(g->stats().calls[CommStats::kAllgather], 1);
          EXPECT_EQ(g->stats().bytes[CommStats::kAllgather], flat.numel() * flat.element_size());
        }
      }
      // Random floats: the tree's sum, within float's rounding of the exact one.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + r);  // this rank's own (ranks are threads)
      at::Tensor flat = at::randn({row * world}, gen);
      const std::vector<at::Tensor> all = everyones(*g, flat);
      at::Tensor exact = at::zeros({row}, at::kDouble);
      for (int k = 0; k < world; ++k) exact.add_(all[k].narrow(0, r * row, row).to(at::kDouble));
      g->reduce_scatter_rows_async(flat).wait();
      EXPECT_TRUE(at::allclose(flat.narrow(0, r * row, row).to(at::kDouble), exact, 1e-5, 1e-5));
    });
  }
}

// At other sizes of 8 or more the all-gather goes in rounds of Bruck's algorithm (Note [Row
// rounds]): every rank ends with each owner's row, different on every rank, for every dtype and
// with `own`; one collective in stats(), counting the buffer's bytes.
TEST(Rows, AllGatherInRoundsAtOtherSizesGivesEveryRankEachRow) {
  for (int world : {9, 12}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      for (int64_t row : {int64_t{1}, int64_t{333}}) {
        for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(600 + r);  // this rank's own (ranks are threads)
          at::Tensor flat = at::full({row * world}, -1.0, dtype);
          const at::Tensor mine = at::randn({row}, gen).to(dtype);
          flat.narrow(0, r * row, row).copy_(mine);
          const std::vector<at::Tensor> owned = everyones(*g, mine);
          g->reset_stats();
          g->allgather_rows_async(flat).wait();
          for (int k = 0; k < world; ++k) {
            ASSERT_TRUE(flat.narrow(0, k * row, row).equal(owned[k]))
                << "row " << k << " on rank " << r << " at world " << world << ", " << dtype << ", rows of " << row;
          }
          EXPECT_EQ(g->stats().calls[CommStats::kAllgather], 1);
          EXPECT_EQ(g->stats().bytes[CommStats::kAllgather], flat.numel() * flat.element_size());
          at::Tensor again = at::zeros({row * world}, dtype);
          g->allgather_rows_async(again, std::nullopt, mine).wait();
          ASSERT_TRUE(again.equal(flat)) << "with own, rank " << r << " at world " << world;
        }
      }
    });
  }
}

// At other sizes of 8 or more, small rows are reduce-scattered in rounds of Bruck's algorithm run
// backwards (Note [Row rounds]): every rank's row is the sum over ranks, exactly for whole
// numbers in every dtype, with the own contribution in the buffer or in an output row, and for
// random floats within float's rounding of the exact sum, as a tree (not the rank-order chain
// of the direct transfers); one collective in stats(), counting the buffer's bytes.
TEST(Rows, ReduceScatterInRoundsAtOtherSizesSumsEachRowOnItsOwner) {
  for (int world : {9, 12}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      for (int64_t row : {int64_t{1}, int64_t{1001}}) {
        for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
          auto gen = at::make_generator<at::CPUGeneratorImpl>(700 + r);  // this rank's own (ranks are threads)
          const at::Tensor flat = at::randint(-8, 9, {row * world}, gen, at::kDouble).to(dtype);
          const std::vector<at::Tensor> all = everyones(*g, flat);
          at::Tensor expected = at::zeros({row}, at::kDouble);
          for (int k = 0; k < world; ++k) expected.add_(all[k].narrow(0, r * row, row).to(at::kDouble));
          expected = (expected / world).to(dtype);
          g->reset_stats();
          at::Tensor plain = flat.clone();
          g->reduce_scatter_rows_async(plain, world).wait();
          ASSERT_TRUE(plain.narrow(0, r * row, row).equal(expected))
              << "rank " << r << " at world " << world << ", " << dtype << ", rows of " << row;
          EXPECT_EQ(g->stats().calls[CommStats::kReduceScatter], 1);
          EXPECT_EQ(g->stats().bytes[CommStats::kReduceScatter], flat.numel() * flat.element_size());
          at::Tensor out = flat.narrow(0, r * row, row).clone();
          at::Tensor elsewhere = flat.clone();
          elsewhere.narrow(0, r * row, row).fill_(100);
          g->reduce_scatter_rows_into_async(elsewhere, out, world).wait();
          ASSERT_TRUE(out.equal(expected)) << "into, rank " << r << " at world " << world << ", " << dtype;
        }
      }
      auto gen = at::make_generator<at::CPUGeneratorImpl>(900 + r);  // this rank's own (ranks are threads)
      at::Tensor flat = at::randn({1001 * world}, gen);
      const std::vector<at::Tensor> all = everyones(*g, flat);
      at::Tensor exact = at::zeros({1001}, at::kDouble), chain = all[r].narrow(0, r * 1001, 1001).clone();
      for (int k = 0; k < world; ++k) {
        exact.add_(all[k].narrow(0, r * 1001, 1001).to(at::kDouble));
        if (k != r) chain.add_(all[k].narrow(0, r * 1001, 1001));
      }
      g->reduce_scatter_rows_async(flat).wait();
      const at::Tensor mine = flat.narrow(0, r * 1001, 1001);
      EXPECT_TRUE(at::allclose(mine.to(at::kDouble), exact, 1e-5, 1e-5));
      EXPECT_FALSE(mine.equal(chain)) << "summed as the direct transfers do, not in rounds";
    });
  }
}

// Below 8 ranks, rows of 1 MiB or more are reduce-scattered by direct transfers summed on the
// group's worker thread as they arrive (Note [Row rounds]): the same bits as every other direct
// reduce-scatter, its own row first, then the others in rank order, then the division; with the
// own contribution in the buffer, in an output row, or summed into its own row; one collective in
// stats(), counting the buffer's bytes.
TEST(Rows, LargeRowsBelowEightRanksSumInRankOrder) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      const int64_t row = 300000;  // 1.2 MB of float
      for (auto dtype : {at::kFloat, at::kDouble}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(1100 + r);  // this rank's own (ranks are threads)
        const at::Tensor flat = at::randn({row * world}, gen).to(dtype);
        const std::vector<at::Tensor> all = everyones(*g, flat);
        at::Tensor expected = all[r].narrow(0, r * row, row).clone();
        for (int k = 0; k < world; ++k) {
          if (k != r) expected.add_(all[k].narrow(0, r * row, row));
        }
        expected.div_(world);
        g->reset_stats();
        at::Tensor plain = flat.clone();
        g->reduce_scatter_rows_async(plain, world).wait();
        ASSERT_TRUE(plain.narrow(0, r * row, row).equal(expected)) << "rank " << r << " at world " << world << ", " << dtype;
        EXPECT_EQ(g->stats().calls[CommStats::kReduceScatter], 1);
        EXPECT_EQ(g->stats().bytes[CommStats::kReduceScatter], flat.numel() * flat.element_size());
        at::Tensor to = at::empty({row}, flat.options());
        at::Tensor again = flat.clone();
        g->reduce_scatter_rows_async(again, world, to).wait();
        ASSERT_TRUE(to.equal(expected)) << "to, rank " << r << " at world " << world << ", " << dtype;
        at::Tensor out = flat.narrow(0, r * row, row).clone();
        at::Tensor elsewhere = flat.clone();
        elsewhere.narrow(0, r * row, row).fill_(100);
        g->reduce_scatter_rows_into_async(elsewhere, out, world).wait();
        ASSERT_TRUE(out.equal(expected)) << "into, rank " << r << " at world " << world << ", " << dtype;
        EXPECT_TRUE(elsewhere.narrow(0, r * row, row).equal(at::full({row}, 100, flat.options())))
            << "the own row of the buffer is left alone";
      }
    });
  }
}

// Rounds run on each group's worker thread in the order they were started, so ranks may wait for
// them in different orders (here half the ranks wait for the all-gather started second first,
// with one of Gloo's own all-reduces between them) and every rank still gets its data.
TEST(Rows, RoundsWaitedInDifferentOrdersOnDifferentRanksComplete) {
  run_ranks(8, [](std::shared_ptr<ProcessGroup> g) {
    const int r = g->rank();
    const int64_t row = 64;
    at::Tensor grads = at::full({row * 8}, static_cast<double>(r + 1));
    at::Tensor params = at::full({row * 8}, -1.0);
    params.narrow(0, r * row, row).fill_(10.0 * r);
    at::Tensor count = at::ones({1});
    PendingWork reduce = g->reduce_scatter_rows_async(grads);
    PendingWork total = g->allreduce_async(count);
    PendingWork gather = g->allgather_rows_async(params);
    if (r % 2 == 1) {
      gather.wait();
      total.wait();
      reduce.wait();
    } else {
      reduce.wait();
      total.wait();
      gather.wait();
    }
    EXPECT_TRUE(grads.narrow(0, r * row, row).equal(at::full({row}, 36.0)));  // 1 + 2 + .. + 8
    EXPECT_EQ(count.item<float>(), 8.0f);
    for (int k = 0; k < 8; ++k) EXPECT_TRUE(params.narrow(0, k * row, row).equal(at::full({row}, 10.0 * k)));
  });
}

// A rank that never starts the collective: every other rank's wait ends within its timeout with
// an error naming the reduce-scatter and the rank, not a hang.
// (At 8 ranks in rounds, and at 3 with rows of 1 MiB, summed on the worker thread.)
TEST(Rows, RoundsWithARankMissingFailWithinTheTimeout) {
  for (const auto& [world, row] : {std::pair{8, int64_t{16}}, std::pair{3, int64_t{300000}}}) {
    const auto errors = testing::run_ranks_collect_errors(
        world,
        [world = world, row = row](std::shared_ptr<ProcessGroup> g) {
          if (g->rank() == 0) return;
          at::Tensor flat = at::ones({world * row});
          g->reduce_scatter_rows_async(flat).wait();
        },
        std::chrono::seconds(3));
    EXPECT_EQ(errors[0], "");
    for (int r = 1; r < world; ++r) {
      EXPECT_NE(errors[r].find("reduce_scatter"), std::string::npos) << "rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find("on rank " + std::to_string(r)), std::string::npos) << "rank " << r << ": " << errors[r];
    }
  }
}

// With `own`, a rank's row is set from it before the all-gather: every rank ends with each rank's
// `own`, which is left as it was, at 2, 3 and (in rounds) 8 ranks.
TEST(Rows, AllGatherOfAnotherTensorsValuesSpreadsThem) {
  for (int world : {2, 3, 8}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int64_t row = 37;
      auto gen = at::make_generator<at::CPUGeneratorImpl>(300 + g->rank());  // this rank's own (ranks are threads)
      at::Tensor flat = at::randn({row * world}, gen);
      const at::Tensor own = at::randn({row}, gen), own_before = own.clone();
      const auto owns = everyones(*g, own);
      g->allgather_rows_async(flat, std::nullopt, own).wait();
      for (int k = 0; k < world; ++k) {
        ASSERT_TRUE(flat.narrow(0, k * row, row).equal(owns[k])) << "row " << k << " at world " << world;
      }
      ASSERT_TRUE(own.equal(own_before));
    });
  }
}

TEST(Rows, AWorldOfOneDividesOnly) {
  run_ranks(1, [](std::shared_ptr<ProcessGroup> g) {
    at::Tensor flat = at::full({5}, 6.0);
    g->reduce_scatter_rows_async(flat, 3.0).wait();
    EXPECT_TRUE(flat.equal(at::full({5}, 2.0)));
    g->allgather_rows_async(flat).wait();
    EXPECT_TRUE(flat.equal(at::full({5}, 2.0)));
  });
}

// A buffer that does not cut into equal rows, or is not 1-D contiguous, is an error naming it.
TEST(Rows, BadBuffersAreErrorsNamingThem) {
  run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    auto message = [&](auto&& call) {
      try {
        call();
      } catch (const c10::Error& e) {
        return std::string(e.what_without_backtrace());
      }
      return std::string("no error");
    };
    at::Tensor odd = at::zeros({7});
    EXPECT_NE(message([&] { g->reduce_scatter_rows_async(odd); }).find("7 elements do not cut into 2 equal rows"),
              std::string::npos);
    EXPECT_NE(message([&] { g->allgather_rows_async(odd); }).find("7 elements do not cut into 2 equal rows"),
              std::string::npos);
    at::Tensor square = at::zeros({2, 2});
    EXPECT_NE(message([&] { g->allgather_rows_async(square); }).find("needs a 1-D contiguous tensor, got sizes [2, 2]"),
              std::string::npos);
    at::Tensor even = at::zeros({4});
    EXPECT_NE(message([&] { g->reduce_scatter_rows_async(even, 0.0); }).find("divisor must be positive, got 0"),
              std::string::npos);
    EXPECT_NE(message([&] { g->reduce_scatter_rows_async(even, 1.0, at::zeros({2}, at::kDouble)); })
                  .find("the output must be one contiguous row of 2 elements of float on cpu, got sizes [2] of double"),
              std::string::npos);
    EXPECT_NE(message([&] { g->allgather_rows_async(even, std::nullopt, at::zeros({3})); })
                  .find("this rank's row must be one contiguous row of 2 elements of float on cpu, got sizes [3]"),
              std::string::npos);
    EXPECT_NE(message([&] { g->reduce_scatter_rows_async(even, 1.0, {}, std::nullopt, 1, {0, 2}); })
                  .find("row 1's 2 used elements and 1 exact ones do not fit in a row of 2"),
              std::string::npos);
    EXPECT_NE(message([&] { g->allgather_rows_async(even, std::nullopt, {}, {1}); })
                  .find("`used` needs one count per row (2), got 1"),
              std::string::npos);
  });
}

// Rows with padding (Note [Rows with padding]): each row's first used[r] elements and its last
// three (flags, exact_tail) are live, an empty row (used 0) has none. The reduce-scatter sums the
// live elements bit for bit as in a whole row (own row first, then rank order, then the
// division) and leaves the padding as this rank had it; the all-gather copies each row's used
// elements and leaves the rest alone. Only live elements cross the wire: the bytes the ranks
// write (all of them, in this one process) are those of the live elements, plus under 64 KiB of
// headers and barriers, far below the padded rows', at 2 and 4 ranks and at 9, where whole rows
// go in rounds.
TEST(Rows, RowsWithPaddingMoveOnlyTheirLiveElements) {
  for (int world : {2, 4, 9}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      const int64_t row = 20000, tail = 3;
      std::vector<int64_t> used(static_cast<size_t>(world));
      for (int k = 0; k < world; ++k) used[k] = k % 3 == 1 ? 0 : k == 0 ? row - tail : 1 + (k * 3119) % (row - tail);
      int64_t live = 0, heads = 0;
      for (int64_t u : used) live += u == 0 ? 0 : u + tail, heads += u;
      // Bytes all ranks write for `collective`, measured between barriers by rank 0.
      auto written = [&](const std::function<void()>& collective) {
        int64_t before = 0;
        g->barrier();
        if (r == 0) before = testing::written_bytes();
        g->barrier();
        collective();
        g->barrier();
        const int64_t bytes = r == 0 ? testing::written_bytes() - before : 0;
        g->barrier();
        return bytes;
      };
      for (const bool into : {false, true}) {
        auto gen = at::make_generator<at::CPUGeneratorImpl>(1300 + r);  // this rank's own (ranks are threads)
        const at::Tensor flat = at::randn({row * world}, gen);
        const std::vector<at::Tensor> all = everyones(*g, flat);
        at::Tensor expected = all[r].narrow(0, r * row, row).clone();
        for (int64_t at_row : {int64_t{0}, row - tail}) {
          const int64_t len = at_row == 0 ? used[r] : used[r] == 0 ? 0 : tail;
          if (len == 0) continue;
          at::Tensor part = expected.narrow(0, at_row, len);
          for (int k = 0; k < world; ++k) {
            if (k != r) part.add_(all[k].narrow(0, r * row + at_row, len));
          }
          part.div_(world);
        }
        at::Tensor buffer = flat.clone(), out = flat.narrow(0, r * row, row).clone();
        g->reset_stats();
        const int64_t bytes = written([&] {
          (into ? g->reduce_scatter_rows_into_async(buffer, out, world, std::nullopt, tail, used)
                : g->reduce_scatter_rows_async(buffer, world, {}, std::nullopt, tail, used))
              .wait();
        });
        const at::Tensor mine = into ? out : buffer.narrow(0, r * row, row);
        ASSERT_TRUE(mine.equal(expected)) << "rank " << r << " at world " << world << (into ? ", into" : "")
                                          << ": max diff " << (mine - expected).abs().max().item<double>();
        EXPECT_EQ(g->stats().calls[CommStats::kReduceScatter], 1);
        if (r == 0) {
          const int64_t sent = (world - 1) * live * 4, padded = world * (world - 1) * row * 4;
          EXPECT_GE(bytes, sent) << "world " << world << ": is /proc/self/io counting?";
          EXPECT_LE(bytes, sent + 65536) << "world " << world << ": the padded rows would write " << padded;
        }
      }
      auto gen = at::make_generator<at::CPUGeneratorImpl>(1400 + r);  // this rank's own (ranks are threads)
      at::Tensor params = at::randn({row * world}, gen);
      const at::Tensor before = params.clone();
      const std::vector<at::Tensor> owned = everyones(*g, params.narrow(0, r * row, row).clone());
      const int64_t bytes = written([&] { g->allgather_rows_async(params, std::nullopt, {}, used).wait(); });
      for (int k = 0; k < world; ++k) {
        const at::Tensor got = params.narrow(0, k * row, row), had = before.narrow(0, k * row, row);
        EXPECT_TRUE(got.narrow(0, 0, used[k]).equal(owned[k].narrow(0, 0, used[k]))) << "row " << k << " on rank " << r;
        if (k != r) EXPECT_TRUE(got.narrow(0, used[k], row - used[k]).equal(had.narrow(0, used[k], row - used[k])));
      }
      if (r == 0) {
        EXPECT_GE(bytes, (world - 1) * heads * 4) << "world " << world;
        EXPECT_LE(bytes, (world - 1) * heads * 4 + 65536) << "world " << world;
      }
    });
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
