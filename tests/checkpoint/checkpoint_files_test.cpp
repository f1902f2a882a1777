// A checkpoint's files: the file layer (the folder's sync, writers of one path), where a save's
// parts go and what names them (save ids, shardopt 0.4's names, missing folders, a main file
// copied alone), each rank's cleanup of older parts, and the ShardedDDP form's optimizer check.
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

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
