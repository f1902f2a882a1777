// Collectives per step and rank under OSS + ShardedDDP with row buckets (Note [Row buckets]): one
// reduce-scatter and one all-gather per bucket, plus a constant that does not depend on the world
// size, counted from ProcessGroup::stats() at 2, 3, 4, 16 and 64 ranks (8 and 16 with Muon;
// threads of this process over Gloo) on the same model, while the parameters follow the
// all-reduce reference through a freeze and an unfreeze. With AdamW alone, and with Muon on six
// hidden matrices (rows of whole parameters, Note [Rows of whole parameters]).
#include <shardopt/ddp/sharded_ddp.h>
#include <shardopt/optim/muon.h>
#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"
#include "parity.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/nn/modules/activation.h>
#include <torch/csrc/api/include/torch/nn/modules/container/sequential.h>
#include <torch/csrc/api/include/torch/nn/modules/linear.h>
#include <torch/csrc/api/include/torch/optim/adamw.h>

#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

// 5 -> 16 -> ... -> 16 -> 3 with `hidden` 16 x 16 layers: 691 elements in 8 tensors with two.
torch::nn::Sequential net_of(uint64_t seed, int hidden = 2) {
  auto made = torch::nn::Sequential(torch::nn::Linear(5, 16), torch::nn::Tanh());
  for (int l = 0; l < hidden; ++l) {
    made->push_back(torch::nn::Linear(16, 16));
    made->push_back(torch::nn::Tanh());
  }
  made->push_back(torch::nn::Linear(16, 3));
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::NoGradGuard no_grad;
  for (auto& p : made->parameters()) p.copy_(at::randn(p.sizes(), gen) * 0.3);
  return made;
}

optim::AdamWOptions adamw() { return optim::AdamWOptions(1e-2).weight_decay(0.01); }

// What one rank counted over the measured steps.
struct Count {
  int64_t per_step = 0;       // every collective
  int64_t rows_per_step = 0;  // reduce-scatters and all-gathers
  int64_t buckets = 0;
  bool operator==(const Count& o) const {
    return per_step == o.per_step && rows_per_step == o.rows_per_step && buckets == o.buckets;
  }
};

// With Muon: on the hidden layers' weights (6 of them), AdamW on the rest, in float64. Muon
// orthogonalises its update in bfloat16 (Note [Muon's step]), which turns the last-bit difference
// between two orders of summing the ranks' fp32 gradients into differences of 3e-3 in a matrix
// after six steps at world 4 (measured); summed in float64, the two orders round to the same
// bfloat16 input, and the update is the reference's to within float64 rounding.
constexpr int kMuonHidden = 6;
constexpr double kMuonTolerance = 1e-9;
MuonOptions muon() { return MuonOptions(0.02).weight_decay(0.01); }
bool is_hidden_weight(size_t i) { return i >= 2 && i < 2 + 2 * kMuonHidden && i % 2 == 0; }
Params pick(const Params& all, bool matrices) {
  Params out;
  for (size_t i = 0; i < all.size(); ++i) {
    if (is_hidden_weight(i) == matrices) out.push_back(all[i]);
  }
  return out;
}

// Steps 0-1 warm up, 2-3 freeze the first layer, 4-5 unfreeze it; steps 1, 3 and 5 are counted
// (the first step of each trainable set lays out and rebuilds, which counts apart).
std::map<int, std::vector<Count>> count_at(const std::vector<int>& worlds, const ShardedDDPOptions& options,
                                           bool with_muon = false) {
  std::map<int, std::vector<Count>> out;
  std::mutex mu;
  const int hidden = with_muon ? kMuonHidden : 2;
  for (int world : worlds) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = net_of(5, hidden), ref_net = net_of(5, hidden);
      if (with_muon) net->to(at::kDouble), ref_net->to(at::kDouble);  // see kMuonTolerance
      Params params = net->parameters(), ref = ref_net->parameters();
      std::vector<OptimizerGroup> groups;
      if (with_muon) groups.push_back({pick(params, true), optimizer<Muon>(muon())});
      groups.push_back({with_muon ? pick(params, false) : params, optimizer<optim::AdamW>(adamw())});
      OSS oss(std::move(groups), g);
      ShardedDDP ddp(net.ptr(), oss, options);
      optim::AdamW ref_opt(with_muon ? pick(ref, false) : ref, adamw());
      Muon ref_muon(with_muon ? pick(ref, true) : Params{}, muon());
      for (const auto& group : oss.layout().groups()) EXPECT_TRUE(group.rows) << "the default partition lays out row buckets";
      Count c;
      for (int step = 0; step < 6; ++step) {
        const bool frozen = step == 2 || step == 3;
        params[0].requires_grad_(!frozen), ref[0].requires_grad_(!frozen);
        auto data = testing::rank_data(step, g->rank(), 1);
        if (with_muon) data = {data.x.to(at::kDouble), data.y.to(at::kDouble)};
        if (step == 0) ASSERT_TRUE(testing::differs_across_ranks(data.x, *g));
        const CommStats before = g->stats();
        ddp.zero_grad();
        testing::loss_of(ddp.forward(data.x), data, 1).backward();
        oss.step();
        const CommStats& after = g->stats();
        if (step % 2 == 1) {
          c.per_step += after.total_calls() - before.total_calls();
          c.rows_per_step += after.calls[CommStats::kReduceScatter] - before.calls[CommStats::kReduceScatter] +
                             after.calls[CommStats::kAllgather] - before.calls[CommStats::kAllgather];
          c.buckets += static_cast<int64_t>(ddp.num_buckets());
        }
        ref_opt.zero_grad(true);
        ref_muon.zero_grad(true);
        testing::loss_of(ref_net->forward(data.x), data, 1).backward();
        testing::allreduce_grads(ref, *g);
        ref_opt.step();
        if (with_muon) ref_muon.step();
        const std::string where = "world " + std::to_string(world) + ", step " + std::to_string(step);
        if (!with_muon) {
          ASSERT_TRUE(testing::matches_reference(params, ref, *g, 1e-5)) << where;
          continue;
        }
        ASSERT_TRUE(testing::matches_reference(pick(params, false), pick(ref, false), *g, kMuonTolerance)) << where;
        ASSERT_TRUE(testing::matches_reference(pick(params, true), pick(ref, true), *g, kMuonTolerance))
            << where << ", Muon";
      }
      std::lock_guard<std::mutex> lock(mu);
      out[world].push_back(c);
    });
    if (::testing::Test::HasFatalFailure()) return out;
  }
  return out;
}

void expect_flat_in_world_size(const std::map<int, std::vector<Count>>& counts, int64_t min_buckets) {
  const Count& at_four = counts.at(4).front();
  EXPECT_GE(at_four.buckets, min_buckets * 3);
  // One reduce-scatter and one all-gather per bucket.
  EXPECT_EQ(at_four.rows_per_step, 2 * at_four.buckets);
  // The rest (the trainability check, the clearing evidence): a small constant.
  EXPECT_LE(at_four.per_step - at_four.rows_per_step, 3 * 3);
  for (const auto& [world, ranks] : counts) {
    for (const Count& c : ranks) {
      EXPECT_TRUE(c == at_four) << "world " << world << ": " << c.per_step << " collectives over 3 steps ("
                                << c.rows_per_step << " reduce-scatters and all-gathers, " << c.buckets
                                << " buckets); at world 4: " << at_four.per_step << " (" << at_four.rows_per_step
                                << ", " << at_four.buckets << ")";
    }
  }
}

TEST(CollectivesPerStep, DoNotGrowWithTheWorldSize) {
  // Buckets of 1 KiB whatever the world size: several row buckets, the same ones at every size.
  const auto fixed = count_at({2, 3, 4, 16, 64}, ShardedDDPOptions().reduce_bucket_bytes(1024).bucket_bytes_per_rank(0));
  if (::testing::Test::HasFatalFailure()) return;
  expect_flat_in_world_size(fixed, 2);
  // The default rule (bucket_bytes_for: at least 8 MiB, 1 MiB more per rank): one bucket. Up to
  // 16 ranks: the 1 KiB buckets above show the count flat at 64.
  const auto by_default = count_at({2, 4, 16}, ShardedDDPOptions());
  if (::testing::Test::HasFatalFailure()) return;
  expect_flat_in_world_size(by_default, 1);
}

// Muon's six matrices step whole on their owners (balanced by Newton-Schulz cost), in row buckets
// of whole parameters: two collectives per bucket at every world size, where a bucket per owner
// cost two per owner holding a matrix (8 at world 4, 12 from world 6 on).
TEST(CollectivesPerStep, DoNotGrowWithTheWorldSizeWithMuon) {
  // Buckets of 1 KiB, half a float64 matrix: a rank's row holds one matrix, so the more ranks
  // share the six, the fewer buckets they take, never more than at world 4, and the same at 8
  // and 16, where more ranks than matrices leave ranks with none. (The test above counts at 64.)
  const auto fixed = count_at({2, 3, 4, 8, 16}, ShardedDDPOptions().reduce_bucket_bytes(1024).bucket_bytes_per_rank(0),
                              /*with_muon=*/true);
  if (::testing::Test::HasFatalFailure()) return;
  const Count& at_four = fixed.at(4).front();
  for (const auto& [world, ranks] : fixed) {
    for (const Count& c : ranks) {
      EXPECT_EQ(c.rows_per_step, 2 * c.buckets) << "world " << world;
      EXPECT_LE(c.per_step - c.rows_per_step, 3 * 3) << "world " << world;
      if (world >= 4) EXPECT_LE(c.per_step, at_four.per_step) << "world " << world;
    }
  }
  EXPECT_EQ(fixed.at(16).front(), fixed.at(8).front());
  const auto by_default = count_at({2, 4, 16}, ShardedDDPOptions(), /*with_muon=*/true);
  if (::testing::Test::HasFatalFailure()) return;
  expect_flat_in_world_size(by_default, 2);  // one bucket of AdamW's rows, one of Muon's
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
