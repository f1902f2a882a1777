#include "local_ranks.h"

#include <shardopt/comm/launch_env.h>
#include <shardopt/comm/process_group.h>
#include <shardopt/comm/store_server.h>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <fmt/format.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <thread>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

extern char** environ;

namespace shardopt::app {

namespace {

int exit_code_of(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status); }

// After the first failure: how long the other ranks get to exit by themselves, the most a rank
// that is reporting the failure gets (Note [The others' grace]), and how long a rank gets after
// SIGTERM before SIGKILL.
constexpr std::chrono::seconds kStopGrace(5);
constexpr std::chrono::seconds kReportCap(30);
constexpr std::chrono::seconds kKillGrace(10);

// Whether `rank` said in the store that it saw a failure: it is in its roll call, naming who is
// gone (its keys live under torch.distributed's prefix for the first attempt).
bool reporting(const c10::intrusive_ptr<c10d::Store>& store, int rank) {
  try {
    return c10d::PrefixStore("/worker/attempt_0", store).check({"shardopt/failed/" + std::to_string(rank)});
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace

bool under_a_launcher() {
  for (const char* v : {"RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID"}) {
    if (shardopt::env_var(v)) return true;
  }
  return false;
}

// Note [The launcher's store]
// `shardopt train -n N` serves the rendezvous store from its own process, as torchrun's agent
// does, and tells the ranks so (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects as a
// client. With rank 0 serving it, rank 0's death took the store along and the others could only
// say that the store was gone; now they name rank 0 like any other rank, and the store outlives
// every rank, which a run that goes on without a dead rank needs.
//
// Note [The others' grace]
// When one rank fails, the others usually fail right after it and each reports its own error,
// naming the rank that is gone (Note [Roll call]). They get 5 s to exit by themselves; a rank
// still running then is stopped (SIGTERM, with SIGCONT for a stopped one: it may wait in a
// collective for the failed one), unless it is reporting the failure (its failure key is in the
// store), which gets until 30 s after the failure: the grace follows what the ranks do, not a
// guess of how long a loaded machine takes to print. Any rank still there 10 s after SIGTERM, a
// hung or deaf one, is killed: the launcher never waits on a rank forever. tools/launch does the
// same.
int run_local_ranks(int n, char** argv, bool survive_failures) {
  std::vector<std::string> base;
  for (char** e = environ; *e; ++e) {
    const std::string kv = *e;
    const std::string key = kv.substr(0, kv.find('='));
    if (key == "RANK" || key == "WORLD_SIZE" || key == "LOCAL_RANK" || key == "LOCAL_WORLD_SIZE" ||
        key == "MASTER_ADDR" || key == "MASTER_PORT" || key == kLauncherStoreVariable) {
      continue;
    }
    base.push_back(kv);
  }
  // This process serves the rendezvous store (Note [The launcher's store]), so that any rank,
  // rank 0 included, can die and be named by the others.
  // (Port 0: the store's own socket binds a free port, which no other process can take before
  // the ranks connect.)
  c10::intrusive_ptr<c10d::Store> store;
  int port = 0;
  try {
    store = serve_store("127.0.0.1", port);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "shardopt: %s\n", e.what_without_backtrace());
    return 1;
  }
  std::map<pid_t, int> ranks;  // pid -> rank
  auto spawn = [&](int r, bool replacement) -> pid_t {
    std::vector<std::string> env = base;
    if (replacement) env.push_back("SHARDOPT_REPLACEMENT=1");
    for (const auto& kv : {fmt::format("RANK={}", r), fmt::format("WORLD_SIZE={}", n), fmt::format("LOCAL_RANK={}", r),
                           fmt::format("LOCAL_WORLD_SIZE={}", n), std::string("MASTER_ADDR=127.0.0.1"),
                           fmt::format("MASTER_PORT={}", port), fmt::format("{}=True", kLauncherStoreVariable)}) {
      env.push_back(kv);
    }
    std::vector<char*> envp;
    for (auto& kv : env) envp.push_back(kv.data());
    envp.push_back(nullptr);
    pid_t pid = 0;
    const int rc = ::posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv, envp.data());
    if (rc != 0) {
      std::fprintf(stderr, "shardopt: cannot start local rank %d: %s\n", r, std::strerror(rc));
      return 0;
    }
    ranks[pid] = r;
    return pid;
  };
  for (int r = 0; r < n; ++r) {
    if (spawn(r, false) == 0) {
      for (const auto& [p, _] : ranks) ::kill(p, SIGKILL);
      for (const auto& [p, _] : ranks) ::waitpid(p, nullptr, 0);
      return 1;
    }
  }
  std::set<int> replaced;  // ranks a replacement was started for (once each)
  int result = 0;
  bool survived = false, finishing = false;  // --survive-failures: a rank died and the others went on; one finished
  std::chrono::steady_clock::time_point failed_at{}, finish_by{};
  std::map<pid_t, std::chrono::steady_clock::time_point> terminated;  // pid -> when it was sent SIGTERM
  std::set<pid_t> killed;
  while (!ranks.empty()) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, result == 0 && !finishing ? 0 : WNOHANG);
    if (pid == 0) {
      // Note [The others' grace]
      const auto now = std::chrono::steady_clock::now();
      for (const auto& [p, rank] : ranks) {
        if (killed.count(p)) continue;
        if (auto t = terminated.find(p); t != terminated.end()) {
          if (now >= t->second + kKillGrace) {
            std::fprintf(stderr, "shardopt: rank %d did not stop within %lld s of SIGTERM; killed it\n", rank,
                         static_cast<long long>(kKillGrace.count()));
            ::kill(p, SIGKILL);
            killed.insert(p);
          }
        } else if (finishing ? now >= finish_by
                             : now >= failed_at + kStopGrace && (now >= failed_at + kReportCap || !reporting(store, rank))) {
          ::kill(p, SIGTERM), ::kill(p, SIGCONT);
          terminated[p] = now;
        }
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    if (pid < 0) {
      if (errno == EINTR) continue;
      break;
    }
    auto it = ranks.find(pid);
    if (it == ranks.end()) continue;
    const int rank = it->second;
    ranks.erase(it);
    const int code = exit_code_of(status);
    if (finishing && code != 0) {
      std::fprintf(stderr, "shardopt: rank %d exited with code %d after the others finished\n", rank, code);
      continue;
    }
    if (survive_failures && WIFSIGNALED(status) && result == 0 && !ranks.empty()) {
      std::fprintf(stderr, "shardopt: rank %d was killed by signal %d; the others go on without it (--survive-failures)\n",
                   rank, WTERMSIG(status));
      survived = true;
      // A replacement, once per rank, when the run is under way (it asks to join; the run admits it
      // after its next refresh: Note [A replacement joins]).
      bool running = false;
      try {
        // The ranks' keys live under torch.distributed's prefix for the first attempt.
        c10d::PrefixStore ranks_store("/worker/attempt_0", store);
        running = rendezvous_closed(ranks_store);
      } catch (const std::exception&) {
      }
      if (running && replaced.insert(rank).second && spawn(rank, true) != 0) {
        std::fprintf(stderr, "shardopt: started a replacement for rank %d\n", rank);
      }
      continue;
    }
    if (survive_failures && code == 0 && result == 0 && !finishing && !ranks.empty()) {
      // Done: the others should be done too, unless one is stuck (the survivors counted it as gone).
      finishing = true;
      finish_by = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    }
    if (code != 0 && result == 0) {
      result = code;
      failed_at = std::chrono::steady_clock::now();
      if (!ranks.empty()) std::fprintf(stderr, "shardopt: rank %d exited with code %d\n", rank, code);
    }
  }
  if (survived && result == 0) std::fprintf(stderr, "shardopt: the run survived the loss of a rank\n");
  return result;
}

}  // namespace shardopt::app
