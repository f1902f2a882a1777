// save_checkpoint_async: the files hold the state at the call while training goes on, one save
// in flight at a time, a load waits for the save, and a failed write is an error on every rank,
// at wait() or at the next save.
#include <shardopt/checkpoint/async_save.h>
#include <shardopt/checkpoint/checkpoint.h>
#include <shardopt/ddp/sharded_ddp.h>

#include "checkpoint/checkpoint_support.h"
#include "checkpoint/fsync_faults.h"
#include "checkpoint/snapshot.h"
#include "harness.h"

#include <gtest/gtest.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <dirent.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>
#include <thread>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

extern char** environ;

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::adam;
using testing::Net;
using testing::Params;
using testing::remove_tree;
using testing::run_ranks;
using testing::run_ranks_collect_errors;
using testing::temp_dir;
using testing::train;

// What a checkpoint restores into fresh objects at world `world`: rank 0's parameters and the
// consolidated optimizer state, and the step.
struct Loaded {
  Params params;
  torch::IValue state;
  int64_t step = -1;
};
Loaded load_fresh(const std::string& path, int world) {
  Loaded out;
  std::mutex mu;
  run_ranks(world, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    const TrainingState state = load_checkpoint(path, *net, oss);
    oss.consolidate_state_dict(0);
    std::lock_guard<std::mutex> lock(mu);
    if (g->rank() != 0) return;
    out.params = testing::clone_params(net->params);
    out.state = oss.state_dict();
    out.step = state.step;
  });
  return out;
}

// Every tensor of two state dicts (as torch::IValue trees) is bitwise equal.
bool same_tree(const torch::IValue& a, const torch::IValue& b) {
  if (a.isTensor()) return b.isTensor() && a.toTensor().equal(b.toTensor());
  if (a.isGenericDict()) {
    if (!b.isGenericDict() || a.toGenericDict().size() != b.toGenericDict().size()) return false;
    for (const auto& e : a.toGenericDict()) {
      if (!b.toGenericDict().contains(e.key()) || !same_tree(e.value(), b.toGenericDict().at(e.key()))) return false;
    }
    return true;
  }
  if (a.isList()) {
    if (!b.isList() || a.toListRef().size() != b.toListRef().size()) return false;
    for (size_t i = 0; i < a.toListRef().size(); ++i) {
      if (!same_tree(a.toListRef()[i], b.toListRef()[i])) return false;
    }
    return true;
  }
  return a == b;
}

// 3 steps, then a synchronous save and an asynchronous one of the same state; 3 more steps run
// while the asynchronous one is written (they change every parameter and the optimizer state).
// Both files restore the same parameters and state, bit for bit, in both layouts, and the
// writers leave no keys in the store.
TEST(AsyncSave, HoldsTheStateAtTheCallWhileTrainingGoesOn) {
  for (auto layout : {OptimizerStateLayout::kConsolidated, OptimizerStateLayout::kSharded}) {
    const auto dir = temp_dir("async");
    const std::string sync_path = dir + "/sync.ckpt", async_path = dir + "/async.ckpt";
    run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      ShardedDDP ddp(net, oss);
      train(*net, oss, ddp, *g, 0, 3);
      TrainingState state;
      state.step = 3;
      const auto options = CheckpointOptions().optimizer_state(layout);
      save_checkpoint(sync_path, *net, oss, state, options);
      g->barrier();
      const int64_t keys_before = g->store()->getNumKeys();
      PendingCheckpoint pending = save_checkpoint_async(async_path, *net, oss, state, options);
      EXPECT_EQ(pending.path(), async_path);
      const Params at_call = testing::clone_params(net->params);
      train(*net, oss, ddp, *g, 3, 6);
      EXPECT_FALSE(net->params[0].equal(at_call[0])) << "training went on";
      pending.wait();
      EXPECT_TRUE(pending.done());
      pending.wait();  // a second wait returns at once
      g->barrier();     // every rank's writer has finished
      EXPECT_EQ(g->store()->getNumKeys(), keys_before) << "the writers' keys in the store outlive the save";
    });
    const Loaded a = load_fresh(sync_path, 2), b = load_fresh(async_path, 2);
    EXPECT_EQ(b.step, 3);
    ASSERT_EQ(a.params.size(), b.params.size());
    for (size_t i = 0; i < a.params.size(); ++i) EXPECT_TRUE(a.params[i].equal(b.params[i])) << "parameter " << i;
    EXPECT_TRUE(same_tree(a.state, b.state)) << "the optimizer state at the call";
    remove_tree(dir);
  }
}

// The call returns while its files are still being written: the writers are held in their first
// file's fsync until both ranks have returned and trained two more steps, and a synchronous save
// would have come back with done() true. While they write, after the release, the training
// group's collective counts do not move: the writers run no collective on it. The file then holds
// the state at the call.
TEST(AsyncSave, TheCallReturnsBeforeItsFilesAreWrittenAndItsWritersRunNoCollective) {
  const auto dir = temp_dir("async-held");
  const std::string path = dir + "/run.ckpt";
  const auto most = std::chrono::seconds(20);
  const int ran_out_before = testing::file_fsync_waits_ran_out();
  testing::hold_file_fsync(most);
  struct Release {
    ~Release() { testing::release_file_fsync(); }  // whatever happens, later tests are not held
  } release;
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss);
    train(*net, oss, ddp, *g, 0, 3);
    TrainingState state;
    state.step = 3;
    PendingCheckpoint pending =
        save_checkpoint_async(path, *net, oss, state, CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded));
    EXPECT_FALSE(pending.done()) << "the call came back only once its files were written";
    train(*net, oss, ddp, *g, 3, 5);
    g->barrier();
    const int64_t calls = g->stats().total_calls();
    if (g->rank() == 0) testing::release_file_fsync();
    const auto deadline = std::chrono::steady_clock::now() + most;
    while (!pending.done() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    EXPECT_TRUE(pending.done());
    EXPECT_EQ(g->stats().total_calls(), calls) << "a writer ran a collective on the training group: "
                                               << g->stats().to_string();
    pending.wait();
  });
  EXPECT_EQ(testing::file_fsync_waits_ran_out(), ran_out_before) << "the writers were not held, or never released";
  EXPECT_EQ(load_fresh(path, 2).step, 3);
  remove_tree(dir);
}

// A second save finishes the first before it snapshots, and a load with a save in flight finishes
// the save first: each file is whole when it is read. The sharded saves leave only the last
// save's parts.
TEST(AsyncSave, OneSaveInFlightAndALoadWaitsForIt) {
  const auto dir = temp_dir("async-order");
  const std::string path = dir + "/last.ckpt";
  run_ranks(2, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    OSS oss(net->parameters(), adam(), g);
    ShardedDDP ddp(net, oss);
    const auto sharded = CheckpointOptions().optimizer_state(OptimizerStateLayout::kSharded);
    train(*net, oss, ddp, *g, 0, 1);
    TrainingState state;
    state.step = 1;
    PendingCheckpoint first = save_checkpoint_async(path, *net, oss, state, sharded);
    train(*net, oss, ddp, *g, 1, 2);
    state.step = 2;
    PendingCheckpoint second = save_checkpoint_async(path, *net, oss, state, sharded);
    EXPECT_TRUE(first.done()) << "the second save finished the first before its snapshot";
    const Params at_second = testing::clone_params(net->params);
    train(*net, oss, ddp, *g, 2, 4);
    // (the load finishes the second save, then restores it)
    const TrainingState loaded = load_checkpoint(path, *net, oss);
    EXPECT_TRUE(second.done());
    EXPECT_EQ(loaded.step, 2);
    for (size_t i = 0; i < at_second.size(); ++i) EXPECT_TRUE(net->params[i].equal(at_second[i])) << i;
  });
  int parts = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) parts += std::string(e->d_name).rfind("last.ckpt.optim-", 0) == 0;
    ::closedir(d);
  }
  EXPECT_EQ(parts, 2) << "one part per rank, of the last save";
  remove_tree(dir);
}

// A write that fails (the folder is a file) is an error on every rank at wait(), naming the file;
// dropped without wait(), the next save reports it on every rank; the previous checkpoint stays.
TEST(AsyncSave, AFailedWriteIsAnErrorOnEveryRankAtWaitOrAtTheNextSave) {
  const auto dir = temp_dir("async-bad");
  const std::string good = dir + "/good.ckpt", blocker = dir + "/not-a-folder";
  std::ofstream(blocker) << "a file where a folder should be";
  const std::string bad = blocker + "/last.ckpt";
  for (bool wait : {true, false}) {
    const auto errors = run_ranks_collect_errors(2, [&](std::shared_ptr<ProcessGroup> g) {
      auto net = std::make_shared<Net>();
      OSS oss(net->parameters(), adam(), g);
      ShardedDDP ddp(net, oss);
      train(*net, oss, ddp, *g, 0, 1);
      TrainingState state;
      state.step = 1;
      save_checkpoint(good, *net, oss, state);
      {
        PendingCheckpoint pending = save_checkpoint_async(bad, *net, oss, state);
        if (wait) pending.wait();
      }  // not waited for: the destructor joins the writer, and the next save reports the failure
      state.step = 2;
      save_checkpoint(good, *net, oss, state);
    });
    const std::string when = wait ? "at wait(): " : "at the next save: ";
    EXPECT_NE(errors[0].find("'" + blocker + "' is not a folder"), std::string::npos) << when << errors[0];
    EXPECT_NE(errors[1].find("saving checkpoint '" + bad + "' failed on rank 0"), std::string::npos) << when << errors[1];
    EXPECT_EQ(load_fresh(good, 1).step, 1) << when << "the previous checkpoint stays, and no later save ran";
  }
  remove_tree(dir);
}

// Resilient replaces the optimizer and its group after a rank failed (detail::orphan_pending_save
// first): a failed background save of the old group is not lost. Nobody is left to agree on it,
// so this rank reports it alone, as a warning, and it fails no later save.
TEST(AsyncSave, AFailureWhoseGroupWasReplacedIsAWarningOnThatRank) {
  struct Warnings : c10::WarningHandler {
    std::vector<std::string> seen;
    void process(const c10::Warning& w) override { seen.push_back(w.msg()); }
  };
  const auto dir = temp_dir("async-orphan");
  const std::string good = dir + "/good.ckpt", blocker = dir + "/not-a-folder";
  std::ofstream(blocker) << "a file where a folder should be";
  const std::string bad = blocker + "/last.ckpt";
  run_ranks(1, [&](std::shared_ptr<ProcessGroup> g) {
    auto net = std::make_shared<Net>();
    auto oss = std::make_unique<OSS>(net->parameters(), adam(), g);
    TrainingState state;
    state.step = 1;
    { PendingCheckpoint pending = save_checkpoint_async(bad, *net, *oss, state); }  // joined, not agreed on
    Warnings warnings;
    {
      c10::WarningUtils::WarningHandlerGuard guard(&warnings);
      detail::orphan_pending_save(*oss);
    }
    ASSERT_EQ(warnings.seen.size(), 1u);
    EXPECT_NE(warnings.seen[0].find("background save of checkpoint '" + bad + "' failed on this rank"),
              std::string::npos) << warnings.seen[0];
    EXPECT_NE(warnings.seen[0].find("is not a folder"), std::string::npos) << warnings.seen[0];
    oss = std::make_unique<OSS>(net->parameters(), adam(), g);  // the replacement
    EXPECT_NO_THROW(save_checkpoint(good, *net, *oss, state));
  });
  EXPECT_EQ(load_fresh(good, 1).step, 1);
  remove_tree(dir);
}

// A SIGTERM (a preemption) or a SIGKILL (the out-of-memory killer; nothing in the process runs
// after it) while a save is written in the background loses that save only: the process is
// stopped once the writer's temporary file exists (the write has begun and is not renamed into
// place), then sent `signal`; the main file is the last complete save, whole.
void check_a_signal_during_the_background_write(int signal, const std::string& name) {
  const auto dir = temp_dir(name);
  const std::string path = dir + "/last.ckpt";
  int out[2];
  ASSERT_EQ(::pipe(out), 0);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[1], 1);
  posix_spawn_file_actions_addclose(&actions, out[0]);
  std::vector<std::string> env;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e, key = kv.substr(0, kv.find('='));
    if (key != "RANK" && key != "WORLD_SIZE" && key != "MASTER_ADDR" && key != "MASTER_PORT" &&
        key != "TORCHELASTIC_USE_AGENT_STORE") {
      env.push_back(kv);
    }
  }
  for (const char* kv : {"RANK=0", "WORLD_SIZE=1", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=0"}) env.emplace_back(kv);
  std::vector<char*> envp;
  for (auto& kv : env) envp.push_back(kv.data());
  envp.push_back(nullptr);
  std::string worker = SHARDOPT_MP_WORKER, mode = "async_saves", file = path;
  char* argv[] = {worker.data(), mode.data(), file.data(), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(posix_spawn(&pid, worker.c_str(), &actions, nullptr, argv, envp.data()), 0);
  posix_spawn_file_actions_destroy(&actions);
  ::close(out[1]);
  FILE* lines = ::fdopen(out[0], "r");
  char line[64];
  int saved = 0;
  while (saved < 2 && std::fgets(line, sizeof(line), lines)) ++saved;
  ASSERT_EQ(saved, 2) << "the worker did not complete two saves";
  // The main file's temporary file: a save's write is under way and not renamed into place.
  const std::string tmp_prefix = "last.ckpt.tmp.";
  auto writing = [&] {
    bool found = false;
    if (DIR* d = ::opendir(dir.c_str())) {
      while (const dirent* e = ::readdir(d)) found = found || std::string(e->d_name).rfind(tmp_prefix, 0) == 0;
      ::closedir(d);
    }
    return found;
  };
  int status = 0;
  bool caught = false;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!caught && std::chrono::steady_clock::now() < deadline) {
    if (!writing()) {
      ::usleep(200);  // (polling the folder)
      continue;
    }
    ASSERT_EQ(::kill(pid, SIGSTOP), 0);
    ASSERT_EQ(::waitpid(pid, &status, WUNTRACED), pid);
    ASSERT_TRUE(WIFSTOPPED(status));
    caught = writing();
    if (caught) ASSERT_EQ(::kill(pid, signal), 0);
    ASSERT_EQ(::kill(pid, SIGCONT), 0);
  }
  if (!caught) ::kill(pid, SIGKILL);
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(caught) << "the worker was not caught writing within 60 s";
  ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == signal) << "status " << status;
  while (std::fgets(line, sizeof(line), lines)) ++saved;
  std::fclose(lines);
  EXPECT_TRUE(writing()) << "the write in flight was cut short";
  const auto d = read_checkpoint_file(path).toGenericDict();  // whole, checksum and all
  const int64_t step = d.at("step").toInt();
  EXPECT_GE(step, saved) << "the last save reported complete, or one after it";
  const at::Tensor blob = d.at("model").toGenericDict().at("blob").toTensor();
  EXPECT_TRUE(blob.eq(static_cast<double>(step)).all().item<bool>()) << "the blob of the same save, whole";
  remove_tree(dir);
}

TEST(AsyncSave, ASigtermDuringTheBackgroundWriteLeavesThePreviousCheckpoint) {
  check_a_signal_during_the_background_write(SIGTERM, "async-term");
}

TEST(AsyncSave, ASigkillDuringTheBackgroundWriteLeavesThePreviousCheckpoint) {
  check_a_signal_during_the_background_write(SIGKILL, "async-kill");
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
