#include <shardopt/optim/oss.h>

#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim.h>
#include <torch/csrc/api/include/torch/serialize.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using Params = std::vector<at::Tensor>;

constexpr int kGlobalBatch = 12;  // divisible by every world size used here

OptimizerFactory adam() {
  return optimizer<optim::Adam>(optim::AdamOptions(2e-2).betas({0.8, 0.95}).weight_decay(0.01));
}

// One step of the global batch split over the group: loss summed over local samples / G, and
// gradients summed over ranks, so the update does not depend on the world size.
void backward_global(const Params& params, int64_t step, ProcessGroup& g) {
  const int per_rank = kGlobalBatch / g.size();
  testing::loss(params, testing::rank_data(step, g.rank(), per_rank), kGlobalBatch).backward();
  testing::allreduce_grads(params, g, /*average=*/false);
}

Params uninterrupted(int steps) {
  Params p = testing::make_params();
  optim::Adam opt(p, optim::AdamOptions(2e-2).betas({0.8, 0.95}).weight_decay(0.01));
  for (int s = 0; s < steps; ++s) {
    opt.zero_grad();
    testing::loss(p, testing::global_data(s, 0, kGlobalBatch), kGlobalBatch).backward();
    opt.step();
  }
  return p;
}

// Runs steps [0, 5) at world w1, consolidates and hands the state over through `transfer`,
// then steps [5, 10) at world w2 from the restored state.
void resume_across_world_sizes(int w1, int w2, bool through_archive) {
  std::string blob;
  Params handed_over;
  std::mutex mu;
  run_ranks(w1, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::make_params();
    OSS oss(p, adam(), g);
    for (int s = 0; s < 5; ++s) {
      oss.zero_grad(true);
      backward_global(p, s, *g);
      oss.step();
    }
    oss.consolidate_state_dict(0);
    if (g->rank() != 0) {
      EXPECT_THROW(oss.state_dict(), c10::Error);
      return;
    }
    auto sd = oss.state_dict().toGenericDict();
    EXPECT_EQ(sd.at("state").toGenericDict().size(), p.size());
    EXPECT_TRUE(sd.at("state").toGenericDict().at(int64_t{0}).toGenericDict().contains("exp_avg_sq"));
    std::lock_guard<std::mutex> lock(mu);
    if (through_archive) {
      torch::serialize::OutputArchive archive;
      oss.save(archive);
      std::ostringstream out;
      archive.save_to(out);
      blob = out.str();
    } else {
      auto bytes = torch::pickle_save(oss.state_dict());
      blob.assign(bytes.begin(), bytes.end());
    }
    handed_over = testing::clone_params(p);
  });
  ASSERT_FALSE(blob.empty());

  Params expected = uninterrupted(10);
  run_ranks(w2, [&](std::shared_ptr<ProcessGroup> g) {
    Params p = testing::clone_params(handed_over);
    OSS oss(p, optimizer<optim::Adam>(optim::AdamOptions(1.0)), g);  // options come from the state
    if (through_archive) {
      torch::serialize::InputArchive archive;
      std::istringstream in(blob);
      archive.load_from(in);
      oss.load(archive);
    } else {
      oss.load_state_dict(torch::pickle_load(std::vector<char>(blob.begin(), blob.end())));
    }
    EXPECT_DOUBLE_EQ(oss.param_groups()[0].options().get_lr(), 2e-2);
    for (int s = 5; s < 10; ++s) {
      oss.zero_grad(true);
      backward_global(p, s, *g);
      oss.step();
    }
    for (size_t i = 0; i < p.size(); ++i) EXPECT_LE(testing::rel_diff(p[i], expected[i]), 1e-5) << "parameter " << i;
    EXPECT_TRUE(testing::same_on_all_ranks(p, *g));
  });
}

// A state saved by SGD (momentum) loaded into Adam, or Adam's into SGD, would be dropped without
// a word and the run would go on from fresh state: it is one error on every rank, naming both.
TEST(OSSState, AStateOfAnotherOptimizerClassIsAnErrorNamingBoth) {
  const auto sgd = optimizer<optim::SGD>(optim::SGDOptions(0.1).momentum(0.9));
  for (const bool into_adam : {true, false}) {
    const auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      Params p = testing::make_params();
      OSS saver(p, into_adam ? sgd : adam(), g);
      saver.zero_grad(true);
      backward_global(p, 0, *g);
      saver.step();
      saver.consolidate_state_dict(0);
      at::Tensor size = at::zeros({1}, at::kLong);
      std::vector<char> bytes;
      if (g->rank() == 0) bytes = torch::pickle_save(saver.state_dict());
      // Every rank loads rank 0's consolidated state.
      size.fill_(static_cast<int64_t>(bytes.size()));
      g->broadcast(size, 0);
      at::Tensor blob = at::zeros({size.item<int64_t>()}, at::kByte);
      if (g->rank() == 0) std::memcpy(blob.data_ptr(), bytes.data(), bytes.size());
      g->broadcast(blob, 0);
      const std::vector<char> loaded(static_cast<char*>(blob.data_ptr()), static_cast<char*>(blob.data_ptr()) + blob.numel());
      OSS loader(testing::make_params(), into_adam ? adam() : sgd, g);
      loader.load_state_dict(torch::pickle_load(loaded));
    });
    // (Optimizers other tests register may keep the entry too: the list names at least the class.)
    const std::string want = into_adam ? "holds 'momentum_buffer', which Adam does not keep: it was saved by another "
                                         "optimizer (SGD, "
                                       : "holds 'exp_avg', which SGD does not keep: it was saved by another "
                                         "optimizer (Adam or AdamW";
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find(want), std::string::npos) << "rank " << r << ": " << errors[r];
    }
  }
}

TEST(OSSState, ResumeFromFourRanksOnTwo) {
  resume_across_world_sizes(4, 2, /*through_archive=*/false);
}

TEST(OSSState, ResumeFromTwoRanksOnThreeThroughSaveAndLoad) {
  resume_across_world_sizes(2, 3, /*through_archive=*/true);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
