// The parity check itself (tests/parity.h): a rank out of tolerance fails at once on every rank,
// naming itself or the others, and ranks that diverged fail even within tolerance; the checks
// every parity test relies on.
#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using Params = std::vector<at::Tensor>;

TEST(Parity, ARankOutOfToleranceFailsOnEveryRankAndDivergedRanksFailToo) {
  const Params ref = testing::make_params();
  std::vector<std::string> out(2), diverged(2), same(2);
  testing::run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    Params mine = testing::clone_params(ref);
    if (g->rank() == 1) mine[2] = mine[2] * 1.5;  // rank 1 alone, far out of tolerance
    const auto r = testing::matches_reference(mine, ref, *g, 1e-6);
    out[g->rank()] = r ? "passed" : r.message();
    // Within tolerance of the reference on both ranks, but not the same bits on both.
    Params near = testing::clone_params(ref);
    if (g->rank() == 1) near[0] = at::nextafter(near[0], near[0] + 1);  // one ulp up
    const auto d = testing::matches_reference(near, ref, *g, 1e-6);
    diverged[g->rank()] = d ? "passed" : d.message();
    const auto s = testing::matches_reference(testing::clone_params(ref), ref, *g, 1e-6);
    same[g->rank()] = s ? "passed" : s.message();
  });
  EXPECT_NE(out[1].find("parameter 2 differs from the reference"), std::string::npos) << out[1];
  EXPECT_NE(out[0].find("1 other rank(s) differ from the reference"), std::string::npos) << out[0];
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(diverged[r].find("ranks diverged"), std::string::npos) << "rank " << r << ": " << diverged[r];
    EXPECT_EQ(same[r], "passed") << "rank " << r;
  }
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
