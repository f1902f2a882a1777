// Checkpoints against every fault: bad files and parts, a kill during a save or between its parts
// and its main file, a full disk; the previous checkpoint always loads whole.
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
