// Checkpoints: save and load under OSS + ShardedDDP, on the same and on another world size, in
// both optimizer layouts, against an uninterrupted run; and every way a file can be bad.
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

// The rename is durable only once its folder is synced: a folder whose sync fails fails the
// write, naming the folder, rather than reporting a save that a power loss may undo.
TEST(CheckpointFile, AFolderWhoseSyncFailsFailsTheWrite) {
  const std::string dir = temp_dir("fsync");
  testing::folder_fsync_errno = EIO;
  std::string error;
  try {
    write_checkpoint_file(dir + "/one.ckpt", at::ones({4}));
  } catch (const std::exception& e) {
    error = e.what();
  }
  testing::folder_fsync_errno = 0;
  EXPECT_NE(error.find("syncing its folder '" + dir + "' failed"), std::string::npos) << error;
  EXPECT_NE(error.find("Input/output error"), std::string::npos) << error;
  write_checkpoint_file(dir + "/one.ckpt", at::ones({4}));  // and with the sync working, it passes
  EXPECT_TRUE(at::equal(read_checkpoint_file(dir + "/one.ckpt").toTensor(), at::ones({4})));
  remove_tree(dir);
}

// A file system that cannot sync folders (fsync of a folder gives EINVAL) is accepted: the write
// succeeds and the file is whole.
TEST(CheckpointFile, AFileSystemThatCannotSyncFoldersIsAccepted) {
  const std::string dir = temp_dir("fsync-einval");
  testing::folder_fsync_errno = EINVAL;
  std::string error = "none";
  try {
    write_checkpoint_file(dir + "/one.ckpt", at::full({4}, 2.0));
  } catch (const std::exception& e) {
    error = e.what();
  }
  testing::folder_fsync_errno = 0;
  EXPECT_EQ(error, "none");
  EXPECT_TRUE(at::equal(read_checkpoint_file(dir + "/one.ckpt").toTensor(), at::full({4}, 2.0)));
  remove_tree(dir);
}

// Two writers of one path in one process (threads; a save in flight beside another) each write
// a temporary file of their own: every write succeeds, the file is whole afterwards and holds one
// writer's payload, and no temporary file is left.
TEST(CheckpointFile, WritersOfOnePathInOneProcessLeaveOneWholeFile) {
  const std::string dir = ::testing::TempDir() + "shardopt_writers_" + std::to_string(::getpid());
  const std::string path = dir + "/one.ckpt";
  std::vector<std::string> errors(4);
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&, w] {
      try {
        for (int k = 0; k < 8; ++k) write_checkpoint_file(path, at::full({1 << 18}, static_cast<float>(w)));
      } catch (const std::exception& e) {
        errors[w] = e.what();
      }
    });
  }
  for (auto& t : writers) t.join();
  for (int w = 0; w < 4; ++w) EXPECT_EQ(errors[w], "") << "writer " << w;
  const at::Tensor got = read_checkpoint_file(path).toTensor();
  ASSERT_EQ(got.numel(), 1 << 18);
  const float first = got[0].item<float>();
  EXPECT_TRUE(first >= 0 && first < 4 && at::equal(got, at::full_like(got, first))) << "a mix of writers' bytes";
  int left = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) left += std::string(e->d_name).find(".tmp.") != std::string::npos;
    ::closedir(d);
  }
  EXPECT_EQ(left, 0) << "temporary files left in " << dir;
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

// Note [Each rank removes its own parts]: three ranks save twice to one path with no collective
// between. Rank 2 still cleans up after save A while rank 1 has written its part of save B: the
// cleanup leaves that part (a cleanup that removed every part but A's lost both checkpoints). Each
// rank removes its own earlier parts and killed writers' temporary files, and rank 0 those no
// rank of the save writes.
TEST(CheckpointCleanup, ARanksCleanupLeavesTheOtherRanksPartsOfALaterSave) {
  const std::string dir = temp_dir("cleanup");
  const std::string path = dir + "/last.ckpt";
  const std::string older = "0000000000000001", a = "0000000000000002", b = "0000000000000003";
  const std::vector<std::string> files = {
      ".optim-1-of-3." + b,     // rank 1's part of the next save
      ".optim-2-of-3." + older, // rank 2's part of an earlier save
      ".optim-2-of-3." + a,     // rank 2's part of A
      ".feedback-2-of-3." + older,
      ".optim-0-of-4." + older,  // saved at another world size
      ".optim-1-of-3",           // a part without an id (shardopt 0.4)
      ".optim-2-of-3." + a + ".tmp.4242.0",  // temporary files of writers killed before their rename
      ".tmp.4242.1",
      ".optim-1-of-3." + b + ".tmp.4243.0",
  };
  for (const auto& f : files) std::ofstream(path + f) << "x";
  const auto exists = [&](const std::string& f) { return ::access((path + f).c_str(), F_OK) == 0; };
  detail::CheckpointSnapshot snap;
  snap.path = path;
  snap.rank = 2, snap.shard_world = 3, snap.world = 3;
  detail::remove_stale_parts(snap, std::stoll(a, nullptr, 16));
  EXPECT_TRUE(exists(files[0])) << "rank 2's cleanup removed rank 1's part of the next save";
  EXPECT_FALSE(exists(files[1]));
  EXPECT_TRUE(exists(files[2]));
  EXPECT_FALSE(exists(files[3]));
  EXPECT_TRUE(exists(files[4]) && exists(files[5])) << "only rank 0 removes what no rank writes";
  EXPECT_FALSE(exists(files[6]));
  EXPECT_TRUE(exists(files[7]) && exists(files[8])) << "rank 0 writes the main file, rank 1 its part";
  snap.rank = 0;
  detail::remove_stale_parts(snap, std::stoll(a, nullptr, 16));
  EXPECT_TRUE(exists(files[0]) && exists(files[2]) && exists(files[8]));
  EXPECT_FALSE(exists(files[4]));
  EXPECT_FALSE(exists(files[5]));
  EXPECT_FALSE(exists(files[7]));
  remove_tree(dir);
}

// shardopt 0.4 named a sharded checkpoint's parts without the save's id (`<path>.optim-R-of-W`):
// such a checkpoint still loads, the optimizer state from those parts, bit for bit.
TEST(Checkpoint, PartsNamedWithoutAnIdStillLoad) {
  const auto dir = temp_dir("legacy");
  const std::string path = dir + "/last.ckpt";
  std::vector<at::Tensor> saved_state;
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    for (auto& p : net->parameters()) p.mutable_grad() = at::full_like(p, 0.1 * (g->rank() + 1));
    oss.step();
    TrainingState state;
    state.step = 3;
    save_checkpoint(path, *net, oss, state, CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded));
    oss.consolidate_state_dict(0);
    if (g->rank() == 0) {
      for (const auto& e : oss.state_dict().toGenericDict().at("state").toGenericDict()) {
        for (const auto& t : e.value().toGenericDict()) saved_state.push_back(t.value().toTensor().clone());
      }
    }
  });
  int renamed = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("last.ckpt.optim-", 0) != 0) continue;
      const std::string legacy = name.substr(0, name.rfind('.'));  // without ".<id>"
      ASSERT_EQ(std::rename((dir + "/" + name).c_str(), (dir + "/" + legacy).c_str()), 0) << name;
      ++renamed;
    }
    ::closedir(d);
  }
  ASSERT_EQ(renamed, 2);
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    EXPECT_EQ(load_checkpoint(path, *net, oss).step, 3);
    oss.consolidate_state_dict(0);
    if (g->rank() != 0) return;
    size_t k = 0;
    for (const auto& e : oss.state_dict().toGenericDict().at("state").toGenericDict()) {
      for (const auto& t : e.value().toGenericDict()) {
        ASSERT_LT(k, saved_state.size());
        EXPECT_TRUE(at::equal(t.value().toTensor(), saved_state[k++])) << "state entry " << t.key().toStringRef();
      }
    }
    EXPECT_EQ(k, saved_state.size());
  });
  remove_tree(dir);
}

// A save into folders that do not exist yet makes them, as DCP does, in both layouts, and the
// checkpoint loads from there.
TEST(Checkpoint, ASaveMakesTheMissingFoldersOfItsPath) {
  const auto dir = temp_dir("folders");
  for (auto layout : {OptimizerStateLayout::kConsolidated, OptimizerStateLayout::kSharded}) {
    const std::string path = dir + "/runs/" + std::to_string(static_cast<int>(layout)) + "/a/last.ckpt";
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      TrainingState state;
      state.step = 7;
      save_checkpoint(path, *net, oss, state, CheckpointOptions().optimizer_state(layout));
      EXPECT_EQ(load_checkpoint(path, *net, oss).step, 7) << "layout " << static_cast<int>(layout);
    });
  }
  remove_tree(dir);
}

// The ShardedDDP forms take the OSS the ShardedDDP reduces for: another is an error naming the
// file, on save and on load, before anything is written or read.
TEST(Checkpoint, AShardedDDPWithAnotherOptimizerIsAnErrorNamingTheFile) {
  const auto dir = temp_dir("ddp-other");
  const std::string path = dir + "/last.ckpt";
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g), other(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss);
    const std::string want = "checkpoint '" + path + "': the ShardedDDP given does not reduce gradients for the OSS given";
    for (bool save : {true, false}) {
      try {
        if (save) {
          save_checkpoint(path, ddp, other, TrainingState{});
        } else {
          load_checkpoint(path, ddp, other);
        }
        ADD_FAILURE() << (save ? "the save" : "the load") << " with another optimizer went through";
      } catch (const c10::Error& e) {
        EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      }
    }
  });
  EXPECT_FALSE(std::ifstream(path).good()) << "the refused save wrote its file";
  remove_tree(dir);
}

// `cp last.ckpt best.ckpt` on a sharded checkpoint: the copy refuses to load on every rank, naming
// the part it lacks and why; with its parts copied under its name too it loads, and later saves to
// last.ckpt never remove the parts best.ckpt names.
TEST(Checkpoint, AMainFileCopiedWithoutItsPartsRefusesAndSavesLeaveACopysParts) {
  const auto dir = temp_dir("copy");
  const std::string last = dir + "/last.ckpt", best = dir + "/best.ckpt";
  const auto sharded = CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded);
  const auto copy = [](const std::string& from, const std::string& to) {
    std::ofstream(to, std::ios::binary) << std::ifstream(from, std::ios::binary).rdbuf();
  };
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss);
    train(*net, oss, ddp, *g, 0, 2);
    TrainingState state;
    state.step = 2;
    save_checkpoint(last, *net, oss, state, sharded);
  });
  copy(last, best);
  const auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    load_checkpoint(best, *net, oss);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("checkpoint '" + best + "': its optimizer part"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("a main file copied or renamed alone leaves them behind"), std::string::npos) << errors[r];
  }
  // The parts copied under best.ckpt's name too.
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name.rfind("last.ckpt.optim-", 0) == 0) copy(dir + "/" + name, dir + "/best" + name.substr(4));
    }
    ::closedir(d);
  }
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss);
    EXPECT_EQ(load_checkpoint(best, *net, oss).step, 2);
    train(*net, oss, ddp, *g, 2, 4);
    for (int64_t step : {3, 4}) {  // two more saves to last.ckpt: each removes last.ckpt's older parts
      TrainingState state;
      state.step = step;
      save_checkpoint(last, *net, oss, state, sharded);
    }
  });
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    EXPECT_EQ(load_checkpoint(best, *net, oss).step, 2) << "best.ckpt's parts are still there";
    EXPECT_EQ(load_checkpoint(last, *net, oss).step, 4);
  });
  remove_tree(dir);
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

std::vector<char> slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}
void spit(const std::string& path, const std::vector<char>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A missing, truncated, corrupted, wrong-version or foreign file is an error naming the file on
// every rank, never a crash.
TEST(Checkpoint, BadFilesAreErrorsNamingTheFileOnEveryRank) {
  const auto dir = temp_dir("bad");
  const std::string good = dir + "/good.ckpt";
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    save_checkpoint(good, *net, oss, {});
  });
  const std::vector<char> bytes = slurp(good);
  ASSERT_GT(bytes.size(), 100u);
  struct Case {
    std::string name, needle;
    std::vector<char> content;
  };
  std::vector<Case> cases;
  cases.push_back({"truncated", "is truncated", std::vector<char>(bytes.begin(), bytes.end() - 7)});
  auto flipped = bytes;
  flipped[bytes.size() / 2] ^= 0x10;
  cases.push_back({"corrupted", "is corrupted (CRC-32 mismatch)", flipped});
  auto version = bytes;
  version[8] = 9;
  cases.push_back({"version", "has format version 9; this build reads version 1", version});
  cases.push_back({"foreign", "is not a shardopt checkpoint", std::vector<char>(100, 'x')});
  cases.push_back({"empty", "is not a shardopt checkpoint", {}});
  for (const auto& c : cases) spit(dir + "/" + c.name + ".ckpt", c.content);
  cases.push_back({"missing", "cannot open", {}});

  for (const auto& c : cases) {
    const std::string path = dir + "/" + c.name + ".ckpt";
    auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      load_checkpoint(path, *net, oss);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("checkpoint '" + path + "'"), std::string::npos) << c.name << ", rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find(c.needle), std::string::npos) << c.name << ", rank " << r << ": " << errors[r];
    }
  }
  // Another model: the first missing name is named.
  auto errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto other = std::make_shared<torch::nn::Module>();
    other->register_parameter("weight", at::zeros({3}));
    OSS oss(other->parameters(), adam(), g);
    load_checkpoint(good, *other, oss);
  });
  for (int r = 0; r < 2; ++r) EXPECT_NE(errors[r].find("has no parameter 'weight'"), std::string::npos) << errors[r];
  remove_tree(dir);
}

// The entry of `dir` other than `keep`, or "": the temporary file a save in progress writes
// (checkpoint.h: every file is written to a temporary file in the same folder, then renamed over
// the target).
std::string other_entry(const std::string& dir, const std::string& keep) {
  std::string found;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != ".." && name != keep) found = name;
    }
    ::closedir(d);
  }
  return found;
}

// A spawned process, killed and reaped however the test ends.
struct Child {
  pid_t pid = 0;
  bool reaped = false;
  ~Child() {
    if (pid > 0 && !reaped) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// A process killed with SIGKILL in the middle of a save leaves the previous checkpoint intact.
// The kill is made to land inside a save, not left to timing: the test watches the folder until
// the writer's temporary file appears (a save has begun writing its file), stops the writer with
// SIGSTOP, and if the temporary file is still there once it is stopped (the save has not been
// renamed into place), kills it there: a stopped process runs no further instruction. Else the
// save finished meanwhile; the writer goes on and the next save is tried.
TEST(Checkpoint, AKillDuringASaveLeavesThePreviousCheckpointIntact) {
  const auto dir = temp_dir("kill");
  const std::string name = "run.ckpt", path = dir + "/" + name;
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDOUT_FILENO);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::string worker = SHARDOPT_MP_WORKER, mode = "checkpoint_writer";
  char* argv[] = {worker.data(), mode.data(), const_cast<char*>(path.c_str()), nullptr};
  Child writer;
  ASSERT_EQ(posix_spawn(&writer.pid, worker.c_str(), &actions, nullptr, argv, environ), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  const pid_t pid = writer.pid;
  // The writer prints one line per completed save, after its rename. Two saves first: the file
  // the kill must leave intact has itself replaced an earlier one.
  FILE* lines = ::fdopen(out[0], "r");
  char line[64];
  int completed = 0;
  while (completed < 2 && std::fgets(line, sizeof(line), lines)) ++completed;
  ASSERT_EQ(completed, 2) << "the writer did not complete two saves";
  std::string caught;  // the temporary file the writer was killed writing, with its size then
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (caught.empty() && std::chrono::steady_clock::now() < deadline) {
    if (other_entry(dir, name).empty()) {
      const pid_t ended = ::waitpid(pid, &status, WNOHANG);
      writer.reaped = ended == pid;
      ASSERT_EQ(ended, 0) << "the writer exited by itself";
      ::usleep(100);
      continue;
    }
    ASSERT_EQ(::kill(pid, SIGSTOP), 0);
    ASSERT_EQ(::waitpid(pid, &status, WUNTRACED), pid);
    writer.reaped = !WIFSTOPPED(status);
    ASSERT_TRUE(WIFSTOPPED(status)) << "the writer ended instead of stopping";
    const std::string tmp = other_entry(dir, name);
    if (tmp.empty()) {
      ASSERT_EQ(::kill(pid, SIGCONT), 0);  // that save was renamed into place meanwhile
      continue;
    }
    struct stat st {};
    ::stat((dir + "/" + tmp).c_str(), &st);
    caught = "'" + tmp + "', " + std::to_string(st.st_size) + " bytes written";
    ASSERT_EQ(::kill(pid, SIGKILL), 0);  // inside the save: its file created, not renamed yet
  }
  ASSERT_FALSE(caught.empty()) << "the writer was not caught inside a save within 60 s";
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  writer.reaped = true;
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
  // Its remaining lines: every save it completed, the last of them the one the file must hold.
  while (std::fgets(line, sizeof(line), lines)) ++completed;
  std::fclose(lines);
  // The save it was killed in left its temporary file, unfinished and never renamed.
  EXPECT_FALSE(other_entry(dir, name).empty()) << "killed writing " << caught;
  std::string error;
  int64_t count = -1;
  bool blob_whole = false;
  try {
    const auto d = read_checkpoint_file(path).toGenericDict();  // whole, checksum and all
    count = d.at("count").toInt();
    blob_whole = d.at("blob").toTensor().eq(static_cast<double>(count)).all().item<bool>();
  } catch (const std::exception& e) {
    error = e.what();
  }
  remove_tree(dir);
  ASSERT_TRUE(error.empty()) << "the previous checkpoint must survive a kill inside the next save (killed writing "
                             << caught << "): " << error;
  EXPECT_EQ(count, completed) << "the file holds the last completed save, not the killed one (killed writing "
                              << caught << ")";
  EXPECT_TRUE(blob_whole) << "every element of the blob holds the count of its save";
}

// The files of `dir` whose names start with `prefix`.
std::vector<std::string> files_starting(const std::string& dir, const std::string& prefix) {
  std::vector<std::string> found;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) {
      if (std::string(e->d_name).rfind(prefix, 0) == 0) found.push_back(dir + "/" + e->d_name);
    }
    ::closedir(d);
  }
  return found;
}

// A sharded checkpoint's part missing or corrupted, and a checkpoint whose names match the module
// but whose shapes do not: an error on every rank naming the file (and the part, or the shape).
TEST(Checkpoint, BadPartsAndShapesAreErrorsNamingTheFileOnEveryRank) {
  const auto dir = temp_dir("bad-parts");
  const std::string path = dir + "/last.ckpt";
  auto save = [&] {
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      ShardedDDP ddp(net, oss);
      train(*net, oss, ddp, *g, 0, 1);
      save_checkpoint(path, *net, oss, {}, CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded));
    });
  };
  auto load_errors = [&] {
    return testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      load_checkpoint(path, *net, oss);
    });
  };
  save();
  auto part1 = files_starting(dir, "last.ckpt.optim-1-of-2.");
  ASSERT_EQ(part1.size(), 1u);
  ASSERT_EQ(::unlink(part1[0].c_str()), 0);
  auto errors = load_errors();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("checkpoint '" + path + "': its optimizer part 1 of 2, '" + part1[0] + "', is missing"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  save();
  auto part0 = files_starting(dir, "last.ckpt.optim-0-of-2.");
  ASSERT_EQ(part0.size(), 1u);
  std::vector<char> bytes = slurp(part0[0]);
  bytes[bytes.size() / 2] ^= 0x10;
  spit(part0[0], bytes);
  errors = load_errors();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("checkpoint '" + part0[0] + "' is corrupted (CRC-32 mismatch)"), std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  // The same names, another shape: w1 is [8, 5] in the file, [8, 6] in this module.
  save();
  errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    {
      at::NoGradGuard no_grad;
      net->params[0].set_(at::zeros({8, 6}));
    }
    OSS oss(net->parameters(), adam(), g);
    load_checkpoint(path, *net, oss);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r].find("checkpoint '" + path + "': 'w1' has shape [8, 5] but the module's has shape [8, 6]"),
              std::string::npos)
        << "rank " << r << ": " << errors[r];
  }
  remove_tree(dir);
}

// A full disk while saving (a file-size limit, RLIMIT_FSIZE, the process's own: each test runs in
// a process of its own): an error on every rank naming the file, and the previous checkpoint
// intact.
TEST(Checkpoint, AFullDiskDuringASaveIsAnErrorOnEveryRankAndKeepsThePrevious) {
  const auto dir = temp_dir("full");
  const std::string path = dir + "/last.ckpt";
  ::signal(SIGXFSZ, SIG_IGN);  // a write past the limit fails with EFBIG instead of killing the process
  rlimit before{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &before), 0);
  std::vector<std::string> errors;
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (attempt == 1) {
      rlimit small = before;
      small.rlim_cur = 1 << 20;  // 1 MB; the second save's file is 4 MB
      ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
    }
    errors = testing::run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      net->register_buffer("blob", at::full({1 << 20}, static_cast<float>(attempt)));
      OSS oss(net->parameters(), adam(), g);
      TrainingState state;
      state.step = attempt;
      save_checkpoint(path, *net, oss, state);
    });
  }
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &before), 0);
  EXPECT_NE(errors[0].find("checkpoint '" + path + "': write failed: File too large"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("saving checkpoint '" + path + "' failed on rank 0"), std::string::npos) << errors[1];
  const auto d = read_checkpoint_file(path).toGenericDict();
  EXPECT_EQ(d.at("step").toInt(), 0) << "the previous checkpoint, whole";
  EXPECT_TRUE(files_starting(dir, "last.ckpt.tmp.").empty()) << "the failed write's temporary file is removed";
  remove_tree(dir);
}

// The mp_worker's net (tests/mp_worker.cpp): the tiny net's parameters named p0 .. p4.
struct WorkerNet : torch::nn::Module {
  WorkerNet() {
    auto p = testing::make_params();
    for (size_t i = 0; i < p.size(); ++i) params.push_back(register_parameter("p" + std::to_string(i), p[i]));
  }
  Params params;
};

// Rank 0 of a sharded save is killed after every part is on disk and before the main file is
// written (SHARDOPT_FAULT_IN_PHASE, at the save's commit): the previous checkpoint, whose parts
// carry another id, still loads whole, at the world size it was saved at and at another.
TEST(Checkpoint, AKillBetweenASavesPartsAndItsMainFileLeavesThePreviousCheckpoint) {
  const auto dir = temp_dir("commit");
  const std::string path = dir + "/run.ckpt";
  const testing::ReservedPort port;
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    std::vector<std::string> env;
    for (char** e = environ; *e; ++e) {
      const std::string kv = *e, key = kv.substr(0, kv.find('='));
      if (key == "RANK" || key == "WORLD_SIZE" || key == "MASTER_ADDR" || key == "MASTER_PORT" ||
          key == "TORCHELASTIC_USE_AGENT_STORE" || key == "SHARDOPT_FAULT_IN_PHASE") {
        continue;
      }
      env.push_back(kv);
    }
    for (const std::string& kv : {"RANK=" + std::to_string(r), std::string("WORLD_SIZE=2"), std::string("MASTER_ADDR=127.0.0.1"),
                                  "MASTER_PORT=" + std::to_string(port.port()), std::string("SHARDOPT_TEST_TIMEOUT_S=20"),
                                  std::string("SHARDOPT_FAULT_IN_PHASE=0:committing its main file:2")}) {
      env.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    std::string worker = SHARDOPT_MP_WORKER, mode = "sharded_saves", file = path, saves = "3";
    char* argv[] = {worker.data(), mode.data(), file.data(), saves.data(), nullptr};
    pid_t pid = 0;
    ASSERT_EQ(posix_spawn(&pid, worker.c_str(), nullptr, nullptr, argv, envp.data()), 0);
    pids.push_back(pid);
  }
  std::vector<int> status(2);
  for (int r = 0; r < 2; ++r) ASSERT_EQ(::waitpid(pids[r], &status[r], 0), pids[r]);
  ASSERT_TRUE(WIFSIGNALED(status[0]) && WTERMSIG(status[0]) == SIGKILL) << "rank 0 was to be killed at the commit";
  EXPECT_FALSE(WIFEXITED(status[1]) && WEXITSTATUS(status[1]) == 0) << "rank 1's save cannot have succeeded";
  // The kill landed between the parts and the main file: rank 0's part of the second save is on
  // disk beside its part of the first, and no third save began.
  int rank0_parts = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) rank0_parts += std::string(e->d_name).rfind("run.ckpt.optim-0-of-2.", 0) == 0;
    ::closedir(d);
  }
  EXPECT_EQ(rank0_parts, 2) << "the second save's part and the first's";
  EXPECT_EQ(::access((path + ".params-2").c_str(), F_OK), 0) << "the second step ran before its save";
  const auto first = read_checkpoint_file(path + ".params-1").toGenericDict();
  const auto saved = first.at("params").toTensorList();
  const auto saved_state = first.at("optimizer").toGenericDict().at("state").toGenericDict();
  ASSERT_EQ(saved_state.size(), saved.size());
  for (int world : {2, 1}) {
    run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<WorkerNet>();
      OSS oss(net->parameters(), optimizer<optim::Adam>(optim::AdamOptions(1e-2)), g);
      const TrainingState state = load_checkpoint(path, *net, oss);
      EXPECT_EQ(state.step, 1) << "world " << world << ": the first save, whole";
      for (size_t i = 0; i < net->params.size(); ++i) {
        EXPECT_TRUE(net->params[i].equal(saved.get(i))) << "world " << world << ", parameter " << i;
      }
      // The first save's optimizer state, every entry bit for bit, not the second's.
      oss.consolidate_state_dict(0);
      if (g->rank() != 0) return;
      const auto loaded = oss.state_dict().toGenericDict().at("state").toGenericDict();
      ASSERT_EQ(loaded.size(), saved_state.size()) << "world " << world;
      for (const auto& entry : saved_state) {
        const auto got = loaded.at(entry.key()).toGenericDict();
        for (const auto& v : entry.value().toGenericDict()) {
          const std::string what = "world " + std::to_string(world) + ", parameter " +
                                   std::to_string(entry.key().toInt()) + ", " + v.key().toStringRef();
          if (v.value().isTensor()) {
            EXPECT_TRUE(got.at(v.key()).toTensor().equal(v.value().toTensor())) << what;
          } else {
            EXPECT_EQ(got.at(v.key()), v.value()) << what;
          }
        }
      }
    });
  }
  remove_tree(dir);
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
