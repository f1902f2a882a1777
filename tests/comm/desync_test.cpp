// The desync check: ranks that call different collectives, or skip one, get an error naming
// each rank's call and the sequence number, instead of a hang or a silent mix-up.
#include <shardopt/comm/process_group.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

void expect_named(const std::vector<std::string>& errors, const std::vector<std::string>& parts) {
  for (size_t r = 0; r < errors.size(); ++r) {
    for (const auto& part : parts) EXPECT_NE(errors[r].find(part), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

TEST(Desync, RanksCallingDifferentCollectivesAreNamedOnEveryRank) {
  auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    g->set_check_desync(true);
    if (g->rank() == 0) {
      at::Tensor t = at::ones({4});
      g->broadcast(t, 0);
    } else {
      at::Tensor t = at::ones({8});
      g->allreduce(t);
    }
  });
  expect_named(errors, {"ranks are out of step at collective #1", "rank 0 called broadcast #1 of 16 bytes with root 0",
                        "rank 1 called allreduce #1 of 32 bytes"});
}

TEST(Desync, ARankThatSkipsACollectiveIsNamed) {
  auto errors = testing::run_ranks_collect_errors(3, [](std::shared_ptr<ProcessGroup> g) {
    g->set_check_desync(true);
    at::Tensor t = at::ones({4});
    g->allreduce(t);
    if (g->rank() != 2) g->allreduce(t);  // rank 2 skips this one
    g->barrier();
  });
  expect_named(errors, {"out of step at collective #2", "rank 0 called allreduce #2 of 16 bytes",
                        "rank 2 called barrier #2 of 0 bytes"});
}

// One rank freezes a parameter with OSS's own check off: from then on the ranks' collectives
// differ (here first the gradient all-reduce, which skips the frozen parameter on that rank), and
// the desync check says so on every rank instead of mixing the buffers up.
TEST(Desync, AFreezeOnOneRankOutsideTheChecksIsCaught) {
  auto errors = testing::run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    g->set_check_desync(true);
    std::vector<at::Tensor> p = testing::make_params();
    OSS oss(p, optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)), g,
            OSSOptions().check_trainable_every_step(false).partition(PartitionMode::kWholeParameters));
    for (int step = 0; step < 2; ++step) {
      if (step == 1 && g->rank() == 1) p[2].requires_grad_(false);
      testing::loss(p, testing::rank_data(step, g->rank(), 3), 3).backward();
      testing::allreduce_grads(p, *g);
      oss.step();
      oss.zero_grad();
    }
  });
  expect_named(errors, {"ranks are out of step at collective #", "rank 0 called allreduce", "rank 1 called allreduce"});
}

// Off, it costs nothing: no collective beyond the user's.
TEST(Desync, OffAddsNoCollective) {
  testing::run_ranks(2, [](std::shared_ptr<ProcessGroup> g) {
    g->set_check_desync(false);
    g->reset_stats();
    at::Tensor t = at::ones({4});
    const uint64_t before = g->sequence();
    g->allreduce(t);
    EXPECT_EQ(g->stats().total_calls(), 1);
    EXPECT_EQ(g->sequence(), before + 1);
  });
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
