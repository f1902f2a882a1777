// Checkpoints: save and load under OSS + ShardedDDP, on the same and on another world size, in
// both optimizer layouts, against an uninterrupted run (a checkpoint's files:
// checkpoint_files_test.cpp; faults: checkpoint_faults_test.cpp).
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/ddp/sharded_ddp.h>

#include "checkpoint/checkpoint_support.h"
#include "checkpoint/fsync_faults.h"
#include "checkpoint/snapshot.h"
#include "harness.h"
#include "model.h"

#include <gtest/gtest.h>
#include <torch/csrc/api/include/torch/optim/adam.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <dirent.h>
#include <ftw.h>
#include <fstream>
#include <mutex>
#include <optional>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

extern char** environ;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

namespace optim = torch::optim;
using testing::run_ranks;
using testing::Net;
using testing::Params;
using testing::adam;
using testing::kGlobalBatch;
using testing::remove_tree;
using testing::temp_dir;
using testing::train;

// Rank 0's parameters: at the end of the uninterrupted run and of the resumed one, at the save, and
// right after the load.
struct Runs {
  Params straight, resumed, saved, loaded;
};

// 6 steps at world w1 uninterrupted; and 3 steps at w1, saved, loaded at w2 into fresh objects,
// 3 more steps. With `ddp_options`, the save and the load are save_checkpoint's and
// load_checkpoint's ShardedDDP forms. The resumed run takes `load_options` and `load_ddp_options`
// where given, else the saving run's.
Runs interrupted_and_not(int w1, int w2, OptimizerStateLayout layout, const std::string& dir, OSSOptions options = {},
                         std::optional<ShardedDDPOptions> ddp_options = std::nullopt,
                         std::optional<OSSOptions> load_options = std::nullopt,
                         std::optional<ShardedDDPOptions> load_ddp_options = std::nullopt) {
  Params straight, resumed, saved, loaded;
  std::mutex mu;
  const std::string path = dir + "/run.ckpt";
  run_ranks(w1, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g, options);
    ShardedDDP ddp(net, oss, ddp_options.value_or(ShardedDDPOptions()));
    train(*net, oss, ddp, *g, 0, 3);
    TrainingState state;
    state.step = 3;
    state.epoch = 1;
    state.scalars["lr_scale"] = 0.5;
    const auto saving = CheckpointOptions().optimizer_state(layout);
    if (ddp_options) {
      save_checkpoint(path, ddp, oss, state, saving);
    } else {
      save_checkpoint(path, *net, oss, state, saving);
    }
    if (g->rank() == 0) saved = testing::clone_params(net->params);
    train(*net, oss, ddp, *g, 3, 6);
    std::lock_guard<std::mutex> lock(mu);
    if (g->rank() == 0) straight = testing::clone_params(net->params);
  });
  run_ranks(w2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    {
      at::NoGradGuard no_grad;
      for (auto& p : net->params) p.mul_(0.5);  // not the saved values: load must restore them
    }
    OSS oss(net->parameters(), adam(), g, load_options.value_or(options));
    ShardedDDP ddp(net, oss, load_ddp_options.value_or(ddp_options.value_or(ShardedDDPOptions())));
    TrainingState state = ddp_options ? load_checkpoint(path, ddp, oss) : load_checkpoint(path, *net, oss);
    if (g->rank() == 0) loaded = testing::clone_params(net->params);
    EXPECT_EQ(state.step, 3);
    EXPECT_EQ(state.epoch, 1);
    EXPECT_EQ(state.scalars.at("lr_scale"), 0.5);
    EXPECT_FALSE(net->params[2].requires_grad()) << "the freeze state at the save is restored";
    EXPECT_EQ(net->named_buffers()["seen"].item<float>(), 3.0f) << "buffers are restored";
    train(*net, oss, ddp, *g, 3, 6);
    std::lock_guard<std::mutex> lock(mu);
    if (g->rank() == 0) resumed = testing::clone_params(net->params);
  });
  return {straight, resumed, saved, loaded};
}

TEST(Checkpoint, ResumeAtTheSameWorldSizeIsBitExact) {
  for (auto layout : {OptimizerStateLayout::kConsolidated, OptimizerStateLayout::kSharded}) {
    const auto dir = temp_dir("same");
    const auto [straight, resumed, saved, loaded] = interrupted_and_not(2, 2, layout, dir);
    ASSERT_EQ(straight.size(), resumed.size());
    for (size_t i = 0; i < straight.size(); ++i) {
      EXPECT_TRUE(at::equal(straight[i], resumed[i])) << "parameter " << i << ", layout " << static_cast<int>(layout);
    }
    remove_tree(dir);
  }
}

// Mixed precision: the checkpoint carries the fp32 masters, so a resumed run steps from them
// (not from the bf16 parameters) and ends bitwise where the uninterrupted one does.
TEST(Checkpoint, MixedPrecisionResumeIsBitExact) {
  const auto options = OSSOptions().mixed_precision(MixedPrecision().param_dtype(at::kBFloat16));
  for (auto layout : {OptimizerStateLayout::kConsolidated, OptimizerStateLayout::kSharded}) {
    const auto dir = temp_dir("mixed");
    const auto [straight, resumed, saved, loaded] = interrupted_and_not(2, 2, layout, dir, options);
    for (size_t i = 0; i < straight.size(); ++i) {
      ASSERT_EQ(straight[i].scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(straight[i], resumed[i])) << "parameter " << i << ", layout " << static_cast<int>(layout);
    }
    remove_tree(dir);
  }
}

// Error feedback (int8 wires on the gradients and the parameters): a sharded checkpoint carries
// every rank's residuals and the parameters' masters, so the resumed run is the straight one bit
// for bit. A consolidated one carries no residuals: the step after the save starts them at zero
// and the runs part (the freeze at steps 2 and 3 keeps step 3's layout the saved one). Another
// world size starts them at zero too, and trains on.
TEST(Checkpoint, ErrorFeedbackResumesBitExactFromAShardedCheckpoint) {
  const auto options = OSSOptions().param_wire(Wire::kInt8);
  const auto ddp_options = ShardedDDPOptions().gradient_wire(Wire::kInt8).error_feedback(true);
  for (auto layout : {OptimizerStateLayout::kSharded, OptimizerStateLayout::kConsolidated}) {
    const auto dir = temp_dir("feedback");
    const auto [straight, resumed, saved, loaded] = interrupted_and_not(2, 2, layout, dir, options, ddp_options);
    ASSERT_EQ(straight.size(), resumed.size());
    bool all_equal = true;
    for (size_t i = 0; i < straight.size(); ++i) all_equal = all_equal && at::equal(straight[i], resumed[i]);
    if (layout == OptimizerStateLayout::kSharded) {
      EXPECT_TRUE(all_equal) << "a sharded checkpoint restores the residuals";
    } else {
      EXPECT_FALSE(all_equal) << "a consolidated checkpoint carries no residuals, yet the resumed run matched";
    }
    remove_tree(dir);
  }
  const auto dir = temp_dir("feedback-other");
  const auto [straight, resumed, saved, loaded] =
      interrupted_and_not(2, 3, OptimizerStateLayout::kSharded, dir, options, ddp_options);
  for (size_t i = 0; i < straight.size(); ++i) {
    EXPECT_LE(testing::rel_diff(resumed[i], straight[i]), 0.05) << "parameter " << i << ", 2 -> 3 ranks";
  }
  remove_tree(dir);
}

// Residuals the checkpoint cannot give start at zero, and rank 0 alone says so once, naming why:
// a consolidated checkpoint carries none; a sharded one saved at another world size has none for
// this one.
TEST(Checkpoint, ResidualsACheckpointCannotGiveStartAtZeroAndRankZeroSaysWhy) {
  struct Warnings : c10::WarningHandler {
    std::vector<std::string> seen;
    void process(const c10::Warning& w) override { seen.push_back(w.msg()); }
  };
  const auto oss_options = OSSOptions().param_wire(Wire::kInt8);
  const auto ddp_options = ShardedDDPOptions().gradient_wire(Wire::kInt8).error_feedback(true);
  const auto dir = temp_dir("feedback-warn");
  const std::string consolidated = dir + "/consolidated.ckpt", sharded = dir + "/sharded.ckpt";
  run_ranks(3, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g, oss_options);
    ShardedDDP ddp(net, oss, ddp_options);
    save_checkpoint(consolidated, ddp, oss, TrainingState{});
    save_checkpoint(sharded, ddp, oss, TrainingState{},
                    CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded));
  });
  for (const auto& [file, reason] : {std::pair<std::string, std::string>{consolidated, "a consolidated checkpoint carries none"},
                                     {sharded, "it was saved at 3 ranks"}}) {
    const std::string path = file, why = reason;  // (a structured binding is not captured)
    std::vector<std::vector<std::string>> seen(2);
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      Warnings warnings;
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g, oss_options);
      ShardedDDP ddp(net, oss, ddp_options);
      load_checkpoint(path, ddp, oss);
      seen[g->rank()] = warnings.seen;
    });
    const std::string want = "checkpoint '" + path + "' holds no error-feedback residuals for 2 ranks (" + why +
                             "): they start at zero";
    ASSERT_EQ(seen[0].size(), 1u) << path;
    EXPECT_NE(seen[0][0].find(want), std::string::npos) << seen[0][0];
    EXPECT_TRUE(seen[1].empty()) << path << ": rank 1 warned too: " << (seen[1].empty() ? "" : seen[1][0]);
  }
  remove_tree(dir);
}

// Resuming with other wire options is not refused (docs/api.md, "gradient_wire"): from a sharded
// checkpoint of int8 wires with error feedback, a run on exact wires starts from the parameters as
// saved (the dequantised values, not the masters the checkpoint also carries) and a run on bf16
// wires with error feedback keeps the residuals; a checkpoint of exact wires resumed on int8 wires
// starts the masters from the parameters. Each resumed run starts from the saved parameters bit for
// bit, trains on near the straight run, and parts from it (its wires differ).
TEST(Checkpoint, ResumingWithOtherWireOptionsIsNotRefused) {
  const auto int8 = OSSOptions().param_wire(Wire::kInt8);
  const auto int8_feedback = ShardedDDPOptions().gradient_wire(Wire::kInt8).error_feedback(true);
  const auto bf16 = OSSOptions().param_wire(Wire::kBFloat16);
  const auto bf16_feedback = ShardedDDPOptions().gradient_wire(Wire::kBFloat16).error_feedback(true);
  struct Case {
    const char* what;
    OSSOptions saving;
    ShardedDDPOptions saving_ddp;
    OSSOptions loading;
    ShardedDDPOptions loading_ddp;
  };
  const Case cases[] = {
      {"int8 with feedback, resumed exact", int8, int8_feedback, OSSOptions(), ShardedDDPOptions()},
      {"int8 with feedback, resumed on bf16 with feedback", int8, int8_feedback, bf16, bf16_feedback},
      {"exact, resumed on int8 with feedback", OSSOptions(), ShardedDDPOptions(), int8, int8_feedback},
  };
  for (const Case& c : cases) {
    const auto dir = temp_dir("rewired");
    const auto [straight, resumed, saved, loaded] = interrupted_and_not(
        2, 2, OptimizerStateLayout::kSharded, dir, c.saving, c.saving_ddp, c.loading, c.loading_ddp);
    ASSERT_EQ(loaded.size(), saved.size()) << c.what;
    bool parted = false;
    for (size_t i = 0; i < saved.size(); ++i) {
      EXPECT_TRUE(at::equal(loaded[i], saved[i])) << c.what << ": parameter " << i << " as saved";
      EXPECT_LE(testing::rel_diff(resumed[i], straight[i]), 0.05) << c.what << ": parameter " << i;
      parted = parted || !at::equal(resumed[i], straight[i]);
    }
    EXPECT_TRUE(parted) << c.what << ": other wires, yet the same bits as the straight run";
    remove_tree(dir);
  }
}

TEST(Checkpoint, ResumeAtAnotherWorldSizeMatchesWithinFloatTolerance) {
  for (auto layout : {OptimizerStateLayout::kConsolidated, OptimizerStateLayout::kSharded}) {
    for (auto [w1, w2] : {std::pair{2, 3}, std::pair{3, 1}}) {
      const auto dir = temp_dir("other");
      const auto [straight, resumed, saved, loaded] = interrupted_and_not(w1, w2, layout, dir);
      for (size_t i = 0; i < straight.size(); ++i) {
        EXPECT_LE(testing::rel_diff(resumed[i], straight[i]), 1e-5)
            << "parameter " << i << ", " << w1 << " -> " << w2 << ", layout " << static_cast<int>(layout);
      }
      remove_tree(dir);
    }
  }
}

// A save leaves only its own shard files beside the main file: those of an earlier save with
// another number of shards (another world size, or a consolidated save) are removed, and the
// checkpoint still loads. Other files in the folder stay.
TEST(Checkpoint, ASaveRemovesTheShardFilesOfEarlierWorldSizes) {
  const auto dir = temp_dir("stale");
  const std::string path = dir + "/last.ckpt";
  std::ofstream(path + ".optim-notes") << "mine";
  const auto exists = [](const std::string& p) { return ::access(p.c_str(), F_OK) == 0; };
  // The parts of rank r of w in the folder (their names end in their save's id).
  const auto parts = [&](int r, int w) {
    const std::string prefix = "last.ckpt.optim-" + std::to_string(r) + "-of-" + std::to_string(w) + ".";
    int n = 0;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) n += std::string(e->d_name).rfind(prefix, 0) == 0;
      ::closedir(d);
    }
    return n;
  };
  const auto save_at = [&](int world, OptimizerStateLayout layout) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      ShardedDDP ddp(net, oss);
      train(*net, oss, ddp, *g, 0, 1);
      save_checkpoint(path, *net, oss, TrainingState{}, CheckpointOptions().optimizer_state(layout));
    });
  };
  save_at(3, OptimizerStateLayout::kSharded);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(parts(r, 3), 1) << r;
  save_at(3, OptimizerStateLayout::kSharded);  // a second save at the same size: its own parts only
  for (int r = 0; r < 3; ++r) EXPECT_EQ(parts(r, 3), 1) << r;
  save_at(2, OptimizerStateLayout::kSharded);
  for (int r = 0; r < 3; ++r) EXPECT_EQ(parts(r, 3), 0) << r;
  for (int r = 0; r < 2; ++r) EXPECT_EQ(parts(r, 2), 1) << r;
  save_at(1, OptimizerStateLayout::kConsolidated);
  for (int r = 0; r < 2; ++r) EXPECT_EQ(parts(r, 2), 0) << r;
  EXPECT_TRUE(exists(path + ".optim-notes"));
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    EXPECT_NO_THROW(load_checkpoint(path, *net, oss));
  });
  remove_tree(dir);
}

// The consolidated optimizer state in a checkpoint is PyTorch's layout: the same as
// consolidate_state_dict() gives (which the Python interop tests load into torch.optim).
TEST(Checkpoint, ConsolidatedOptimizerStateIsTorchOptimsLayout) {
  const auto dir = temp_dir("layout");
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss);
    train(*net, oss, ddp, *g, 0, 2);
    save_checkpoint(dir + "/a.ckpt", *net, oss, {});
    if (g->rank() != 0) return;
    const auto d = read_checkpoint_file(dir + "/a.ckpt").toGenericDict();
    const auto state = d.at("optimizer").toGenericDict().at("state").toGenericDict();
    EXPECT_EQ(state.size(), 5u);
    const auto first = state.at(int64_t{0}).toGenericDict();
    EXPECT_TRUE(first.contains("exp_avg") && first.contains("exp_avg_sq") && first.contains("step"));
    EXPECT_EQ(first.at("exp_avg").toTensor().sizes(), net->params[0].sizes());
  });
  remove_tree(dir);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
